"""Tables and figures of lesson 10's sections 7 and 8 (packed documents, hybrid CP); every one names its hardware."""

from __future__ import annotations

import torch

from course_lib import theory
from course_lib.parallel.context_documents import BALANCERS, document_ids, document_mask, rank_rows

__all__ = ["document_equality", "document_table", "document_mask_figure", "document_times_table",
           "document_times_figure", "hybrid_equality", "hybrid_table", "hybrid_bytes_figure", "ulysses_cap_table"]

BALANCER_COLORS = dict(contiguous="#C44E52", head_tail="#DD8452", per_document="#4C72B0")
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def _worst(rows: list[dict], reference: dict) -> tuple[float, float]:
    """The worst |loss difference| and max |gradient difference| of `rows` against one process."""
    dl = max(abs(row["loss"] - reference["loss"]) for row in rows)
    dg = max((row["grads"][k].cpu() - g).abs().max().item() for row in rows for k, g in reference["grads"].items())
    return dl, dg


def document_equality(results: dict, reference: dict) -> dict:
    """{cp: every rank's `rank_documents` result} vs `document_reference`: {(cp, balancer): (|loss diff|, grad)}."""
    return {(cp, b): _worst([res[b] for res in returns], reference)
            for cp, returns in results.items() for b in returns[0]}


def document_table(results: dict, reference: dict, doc_lens: list[int], batch: int, d_model: int, seq_len: int,
                   hardware: str) -> str:
    """Per cp and balancer: equality with one process, bytes per layer counted vs formula, visible pairs per rank
    counted by the layer (per sequence and head) and, per-document, the closed form."""
    eq = document_equality(results, reference)
    head = (f"{'cp':>3s} {'balancer':13s} {'|loss diff|':>11s} {'max |grad diff|':>15s} {'bytes = formula':>15s}  "
            f"visible pairs per rank (counted; formula)")
    lines = [f"all-gather CP under the document mask, documents {doc_lens}, vs one process; {hardware}", head,
             "-" * len(head)]
    for cp, returns in results.items():
        formula = {f"{ph}/{op}": v for (ph, op), v in
                   theory.context.layer_comm("all_gather", batch, seq_len, d_model, cp).items()}
        for b in returns[0]:
            pairs = [res[b]["pairs"] for res in returns]
            same = all(res[b]["comm"][0] == formula for res in returns)
            closed = (f"; {theory.documents.per_document_work_per_rank(doc_lens, cp)}" if b == "per_document"
                      else "")
            lines.append(f"{cp:3d} {b:13s} {eq[(cp, b)][0]:11.1e} {eq[(cp, b)][1]:15.1e} {str(same):>15s}  "
                         f"{pairs}{closed}")
    return "\n".join(lines)


def document_mask_figure(doc_lens: list[int], cp: int):
    """The (s, s) document mask once per balancer, each visible (query, key) pair coloured by the rank that holds
    the query: how the splits share the documents' work."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    s = sum(doc_lens)
    pos = torch.arange(s)
    visible = document_mask(pos, pos, document_ids(doc_lens)).numpy()    # (s, s)
    fig, axes = plt.subplots(1, len(BALANCERS), figsize=(10, 3.6))
    cmap = ListedColormap(["white", *RANK_COLORS[:cp]])
    for ax, b in zip(axes, BALANCERS):
        owner = np.zeros(s, dtype=int)
        for r in range(cp):
            owner[rank_rows(doc_lens, cp, r, b).numpy()] = r + 1
        image = np.where(visible, owner[:, None], 0)
        ax.imshow(image, cmap=cmap, vmin=0, vmax=cp, interpolation="nearest")
        work = [int((image == r + 1).sum()) for r in range(cp)]
        ax.set_title(f"{b}\nvisible pairs per rank {work}", fontsize=8)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[r]) for r in range(cp)]
    fig.legend(handles, [f"rank {r}" for r in range(cp)], loc="lower center", ncol=cp, fontsize=7)
    fig.suptitle(f"The document mask of documents {doc_lens}, cp={cp}: whose queries (formula, no run)", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def document_times_table(returns: list, doc_lens: list[int]) -> str:
    """Per balancer and rank: visible pairs, scores the per-document kernel computes, measured milliseconds of the
    dense mask and of the per-document kernel."""
    head = (f"{'balancer':13s} {'rank':>4s} {'visible pairs':>13s} {'scores':>10s} {'dense ms':>9s} "
            f"{'per-document ms':>15s}")
    lines = [f"one rank's attention forward, documents {doc_lens}, {len(returns)} ranks; {returns[0]['hardware']}",
             head, "-" * len(head)]
    for b in returns[0]["balancers"]:
        for r, res in enumerate(returns):
            row = res["balancers"][b]
            lines.append(f"{b:13s} {r:4d} {row['pairs']:13,d} {row['scores']:10,d} {row['dense_s'] * 1e3:9.1f} "
                         f"{row['per_document_s'] * 1e3:15.1f}")
    return "\n".join(lines)


def document_times_figure(returns: list, doc_lens: list[int]):
    """Measured per-rank time of the dense mask and of the per-document kernel, per balancer."""
    import matplotlib.pyplot as plt

    cp = len(returns)
    balancers = list(returns[0]["balancers"])
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4), sharey=True)
    width = 0.8 / cp
    for ax, key, title in ((axes[0], "dense_s", "dense (n, s) mask: every score computed"),
                           (axes[1], "per_document_s", "one document at a time")):
        for r in range(cp):
            xs = [i + (r - (cp - 1) / 2) * width for i in range(len(balancers))]
            ax.bar(xs, [returns[r]["balancers"][b][key] * 1e3 for b in balancers], width, color=RANK_COLORS[r],
                   label=f"rank {r}")
        ax.set_xticks(range(len(balancers)))
        ax.set_xticklabels(balancers, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("ms, attention forward (measured)")
    fig.suptitle(f"Documents {doc_lens} on {cp} ranks: {returns[0]['hardware']}", fontsize=8)
    fig.tight_layout()
    return fig


def hybrid_equality(results: dict, reference: dict) -> dict:
    """{ulysses: every rank's `rank_hybrid_lab` result} vs one process: {ulysses: (|loss diff|, max |grad diff|)}."""
    ref = dict(loss=reference["losses"][0], grads=reference["first_grads"])
    return {u: _worst(returns, ref) for u, returns in results.items()}


def hybrid_table(results: dict, reference: dict, batch: int, seq_len: int, d_model: int, hardware: str) -> str:
    """Per mesh u x r: equality with one process; layer 0's calls and bytes counted vs
    `theory.context_hybrid.hybrid_layer_comm`; forward bytes on the wire per rank inside the group and across."""
    eq = hybrid_equality(results, reference)
    head = (f"{'u x r':>6s} {'|loss diff|':>11s} {'max |grad diff|':>15s} {'counted = formula':>17s} "
            f"{'a2a calls':>9s} {'sends':>5s} {'fwd wire in group':>17s} {'across':>9s}")
    lines = [f"hybrid CP on {len(next(iter(results.values())))} ranks (u x r mesh) vs one process; {hardware}", head,
             "-" * len(head)]
    for u, returns in results.items():
        cp = len(returns)
        formula = theory.context_hybrid.hybrid_layer_comm(batch, seq_len, d_model, cp, u)
        same = all(res["comm"] == formula for res in returns)
        calls = {op: sum(v["calls"] for (_, o), v in formula.items() if o == op) for op in ("all_to_all", "send")}
        wire = theory.context_hybrid.hybrid_bytes_sent_per_rank(batch, seq_len, d_model, cp, u, phase="forward")
        lines.append(f"{u:>2d} x {cp // u:<2d} {eq[u][0]:11.1e} {eq[u][1]:15.1e} {str(same):>17s} "
                     f"{calls['all_to_all']:9d} {calls['send']:5d} {wire['ulysses'] / 1e3:14.1f} kB "
                     f"{wire['ring'] / 1e3:6.1f} kB")
    return "\n".join(lines)


def hybrid_bytes_figure(cp: int = 16, seq_len: int = 131072, d_model: int = 8192, dtype_bytes: int = 2):
    """Forward bytes one rank puts on the wire per layer (formula), inside its Ulysses group and across (the ring),
    for every u dividing cp, at B = 1 with multi-head attention."""
    import matplotlib.pyplot as plt

    us = [u for u in range(1, cp + 1) if cp % u == 0]
    wires = [theory.context_hybrid.hybrid_bytes_sent_per_rank(1, seq_len, d_model, cp, u, dtype_bytes, "forward")
             for u in us]
    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    xs = range(len(us))
    inside = [w["ulysses"] / 1e6 for w in wires]
    across = [w["ring"] / 1e6 for w in wires]
    ax.bar(xs, inside, color="#55A868", label="all-to-all inside the Ulysses group")
    ax.bar(xs, across, bottom=inside, color="#4C72B0", label="ring sends across the groups")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"u={u}\nr={cp // u}" for u in us], fontsize=8)
    ax.set_ylabel("MB per layer per rank, forward")
    ax.set_title(f"Hybrid CP, cp={cp}, s={seq_len:,}, C={d_model} (K/V as wide as Q), bf16, B=1\n(formula, no run)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def ulysses_cap_table(names=("llama-7b", "llama3-70b", "llama3-405b"), tps=(1, 8)) -> str:
    """Per model and tp: the heads a TP rank holds and the largest Ulysses degree that splits its K/V heads without
    copies (`theory.context_hybrid.ulysses_degree_cap`) and its query heads at all."""
    from course_lib.config import get_preset

    head = (f"{'model':12s} {'heads (q / kv)':>15s} {'tp':>3s} {'per TP rank':>12s} {'u without K/V copies':>21s} "
            f"{'u at most':>9s}")
    lines = ["Ulysses degree caps (formula, from the models' head counts)", head, "-" * len(head)]
    for name in names:
        cfg = get_preset(name)
        for tp in tps:
            cap = theory.context_hybrid.ulysses_degree_cap(cfg.n_head, cfg.n_kv_head, tp)
            lines.append(f"{name:12s} {cfg.n_head:>8d} / {cfg.n_kv_head:<4d} {tp:3d} {cap.query:>5d} / {cap.kv:<4d} "
                         f"{cap.kv:>21d} {cap.query:>9d}")
    return "\n".join(lines)
