"""Tables and figures of lesson 11's sections 6-11 (grouped GEMMs, the router's precision, the straggler,
node-limited routing, expert tensor parallelism, fine-grained experts); every one names its hardware."""

from __future__ import annotations

import torch

from course_lib import theory
from course_lib.lessons.display import plain_log_ticks
from course_lib.parallel import moe_node_limited as nl

__all__ = ["gemm_curve_table", "gemm_curve_figure", "half_ceiling_tokens", "dropless_table", "router_table",
           "z_loss_figure", "straggler_text", "straggler_figure", "routing_copies", "routing_table",
           "routing_figure", "expert_tp_rows", "expert_tp_table", "fine_grained_table", "fine_grained_seeds",
           "fine_grained_figure"]

WAY_COLORS = dict(grouped="#4C72B0", loop="#DD8452", dense="#55A868")


# ------------------------------------------------------------------------------ section 6: grouped GEMMs

def gemm_curve_table(curve: dict) -> str:
    head = (f"{'tokens/expert':>13s} {'grouped GFLOP/s':>15s} {'loop':>8s} {'dense (ceiling)':>15s} "
            f"{'grouped/dense':>13s}")
    lines = [f"the experts' first matmul, {curve['n_experts']} experts, C={curve['d_model']}, F={curve['d_ff']}, "
             f"{curve['dtype']}, forward; grouped path: {curve['path']} [{curve['hardware']}]", head, "-" * len(head)]
    for r in curve["rows"]:
        lines.append(f"{r['n']:13d} {r['grouped_gflops']:15.1f} {r['loop_gflops']:8.1f} {r['dense_gflops']:15.1f} "
                     f"{r['grouped_gflops'] / r['dense_gflops']:13.2f}")
    return "\n".join(lines)


def half_ceiling_tokens(curve: dict) -> int | None:
    """The fewest tokens per expert at which the grouped matmul reaches half the dense ceiling (None: never)."""
    return next((r["n"] for r in curve["rows"] if r["grouped_gflops"] >= 0.5 * r["dense_gflops"]), None)


def gemm_curve_figure(curves: list[dict]):
    """GFLOP/s over tokens per expert, one panel per dtype: grouped, loop, dense (the ceiling)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.8 * len(curves), 3.6), squeeze=False)
    for ax, curve in zip(axes[0], curves):
        n = [r["n"] for r in curve["rows"]]
        for way, label in (("grouped", f"grouped ({curve['path']})"), ("loop", "per-expert loop"),
                           ("dense", "one dense matmul (ceiling)")):
            ax.plot(n, [r[f"{way}_gflops"] for r in curve["rows"]], "o-", color=WAY_COLORS[way], ms=3, label=label)
        ax.set_xscale("log", base=2)
        plain_log_ticks(ax, "x")
        ax.set_xlabel("tokens per expert")
        ax.set_ylabel("GFLOP/s (measured)")
        ax.set_title(f"{curve['dtype'].replace('torch.', '')}, {curve['n_experts']} experts", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(curves[0]["hardware"], fontsize=8)
    fig.tight_layout()
    return fig


def dropless_table(runs: dict) -> tuple[str, float]:
    """The three ways of `grouped.dropless_runs` against the loop: loss and the largest gradient difference."""
    want = runs["loop, dropless"]
    worst, lines = 0.0, []
    for name, r in runs.items():
        dg = max((r["grads"][k] - g).abs().max().item() for k, g in want["grads"].items())
        worst = max(worst, dg)
        lines.append(f"  {name:22s} loss {r['loss'].item():.6f}  dropped {r['dropped']}  matmuls: {r['path']:10s} "
                     f"max |gradient - loop's| {dg:.1e}")
    return "\n".join(lines), worst


# ------------------------------------------------------------------------------ section 7: the router's precision

def router_table(rows: list[dict], hardware: str) -> str:
    lines = [f"top-2 of 8 experts, {rows[0]['tokens']} tokens, bf16 activations and router weights; choices compared "
             f"with an fp32 computation on the same values [{hardware}]"]
    for r in rows:
        lines.append(f"  router weights std {r['scale']:<5g} (max |logit| {r['max_logit']:.2f}): tokens whose experts "
                     f"change: bf16 router {r['bf16_flips']}, fp32 router {r['fp32_flips']}; max |logit error| of "
                     f"the bf16 router {r['max_logit_diff']:.4f}")
    return "\n".join(lines)


def z_loss_figure(run: dict, hardware: str):
    """Per step: the largest logsumexp of a token's router logits and the cross-entropy, one line per coefficient."""
    import matplotlib.pyplot as plt

    coefs = [c for c in run if c != "ideal"]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4))
    for c in coefs:
        label = "no z-loss" if c == 0 else f"z-loss x {c:g}"
        axes[0].plot(run[c]["max_lse"], label=label)
        axes[1].plot(run[c]["loss"], label=label)
    axes[1].axhline(run["ideal"], color="gray", lw=0.8, ls=":", label="the corpus's entropy rate")
    axes[0].set(xlabel="step", ylabel="max logsumexp of router logits")
    axes[1].set(xlabel="step", ylabel="cross-entropy (nats)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"Tiny MoE GPT, router z-loss (measured) [{hardware}]", fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------ section 8: the straggler

def straggler_text(rows: list[dict], hardware: str) -> str:
    head = (f"{'routing':9s} {'rows per rank':>15s} {'max/mean rows':>13s} {'expert CPU ms':>15s} {'max/mean':>8s} "
            f"{'waited ms':>13s} {'model':>13s} {'saved MB (= formula)':>22s}")
    lines = [f"one MoE layer, forward + backward, 2 EP ranks (each a core) [{hardware}]", head, "-" * len(head)]
    for r in rows:
        ms = lambda xs: "/".join(f"{x * 1e3:.0f}" for x in xs)              # noqa: E731
        mb = "/".join(f"{b / 1e6:.1f}" for b in r["saved_bytes"])
        same = r["saved_bytes"] == r["formula_bytes"]
        lines.append(f"{r['name']:9s} {'/'.join(map(str, r['rows'])):>15s} {r['load_ratio']:13.2f} "
                     f"{ms(r['expert_cpu_s']):>15s} {r['time_ratio']:8.2f} {ms(r['wait_s']):>13s} "
                     f"{ms(r['predicted_wait_s']):>13s} {mb:>16s} ({same})")
    return "\n".join(lines)


def straggler_figure(rows: list[dict], hardware: str):
    """Per routing level and rank: expert compute (CPU time) and time waiting for the other rank; saved bytes."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4))
    ranks = len(rows[0]["rows"])
    width = 0.8 / ranks
    for i, r in enumerate(rows):
        for k in range(ranks):
            x = i + (k - (ranks - 1) / 2) * width
            axes[0].bar(x, r["expert_cpu_s"][k] * 1e3, width, color="#4C72B0", label="experts (CPU time)" if not i
                        and not k else None)
            axes[0].bar(x, r["wait_s"][k] * 1e3, width, bottom=r["expert_cpu_s"][k] * 1e3, color="#BBBBBB",
                        label="waiting at the all-to-alls" if not i and not k else None)
            axes[1].bar(x, r["saved_bytes"][k] / 1e6, width, color="#C44E52" if k == 0 else "#8172B3")
            axes[0].text(x, 0, f"r{k}", ha="center", va="bottom", fontsize=6, color="white")
    for ax, ylabel in ((axes[0], "ms per forward + backward"), (axes[1], "MB the experts keep for backward")):
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["name"] for r in rows])
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    axes[1].set_title("saved by the experts, per rank (measured = (C + 4F) b per row)", fontsize=8)
    fig.suptitle(f"A skewed router on 2 EP ranks: rank 0 holds the favoured experts [{hardware}]", fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------ section 9: node-limited routing

def routing_copies(tokens: int = 4096, n_experts: int = 256, n_nodes: int = 8, top_k: int = 8, max_nodes: int = 4,
                   seed: int = 0) -> dict:
    """Rows that cross nodes per token, counted from routings of random scores (T, E): plain top-k and node-limited,
    each without and with deduplication (tokens spread evenly over the nodes), with the formulas beside."""
    scores = torch.rand(tokens, n_experts, generator=torch.Generator().manual_seed(seed))
    per_node = n_experts // n_nodes
    source = nl.even_source_nodes(tokens, n_nodes)
    plain = scores.topk(top_k, -1).indices
    limited = nl.node_limited_topk(scores, top_k, n_nodes, max_nodes)[1]
    out = dict(shape=dict(tokens=tokens, n_experts=n_experts, n_nodes=n_nodes, top_k=top_k, max_nodes=max_nodes))
    for name, idx in (("top-k", plain), ("node-limited", limited)):
        for dedup in (False, True):
            copies = nl.remote_copies(idx, per_node, source, dedup).float()
            out[(name, dedup)] = dict(mean=copies.mean().item(), max=int(copies.max()),
                                      nodes=int(nl.node_of(idx, per_node).sort(1).values.diff(dim=1).ne(0).sum(1)
                                                .add(1).max()))
    out["formula"] = {("top-k", False): theory.moe_routing.uniform_remote_copies(n_experts, n_nodes, top_k, False),
                      ("top-k", True): theory.moe_routing.uniform_remote_copies(n_experts, n_nodes, top_k, True),
                      ("node-limited", False): theory.moe_routing.node_limited_remote_copies(
                          n_experts, n_nodes, top_k, max_nodes, False)["expected"],
                      ("node-limited", True): theory.moe_routing.node_limited_remote_copies(
                          n_experts, n_nodes, top_k, max_nodes, True)["expected_at_most"]}
    return out


def routing_table(c: dict, bytes_per_token: int) -> str:
    s = c["shape"]
    lines = [f"{s['tokens']} tokens, random scores, {s['n_experts']} experts on {s['n_nodes']} nodes, "
             f"top-{s['top_k']}, "
             f"node-limited to {s['max_nodes']} nodes; a row = {bytes_per_token} B (counted, no run; formula beside)",
             f"{'routing':13s} {'dedup':>6s} {'nodes used, max':>15s} {'copies/token':>12s} {'formula':>14s} "
             f"{'max':>4s} {'MB per dispatch':>15s}"]
    for name in ("top-k", "node-limited"):
        for dedup in (False, True):
            r = c[(name, dedup)]
            f = c["formula"][(name, dedup)]
            formula = f"<= {f:.3f}" if (name, dedup) == ("node-limited", True) else f"{f:.3f}"
            lines.append(f"{name:13s} {str(dedup):>6s} {r['nodes']:15d} {r['mean']:12.3f} {formula:>14s} "
                         f"{r['max']:4d} {r['mean'] * s['tokens'] * bytes_per_token / 1e6:15.1f}")
    return "\n".join(lines)


def routing_figure(c: dict):
    """Copies per token that cross nodes, counted, for the four ways (formula as a tick)."""
    import matplotlib.pyplot as plt

    keys = [("top-k", False), ("top-k", True), ("node-limited", False), ("node-limited", True)]
    fig, ax = plt.subplots(figsize=(6.2, 3.4))
    ax.bar(range(4), [c[k]["mean"] for k in keys], color=["#C44E52", "#DD8452", "#8172B3", "#4C72B0"])
    ax.plot(range(4), [c["formula"][k] for k in keys], "k_", ms=30, mew=2,
            label="formula (node-limited, dedup: bound)")
    ax.set_xticks(range(4))
    ax.set_xticklabels([f"{n}\n{'dedup' if d else 'per expert'}" for n, d in keys], fontsize=8)
    ax.set_ylabel("rows crossing nodes per token")
    s = c["shape"]
    ax.set_title(f"{s['n_experts']} experts on {s['n_nodes']} nodes, top-{s['top_k']}, at most {s['max_nodes']} nodes "
                 f"(counted from a routing; no run)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------ section 10: EP x ETP

def expert_tp_rows(results: dict, references: dict, d_model: int) -> list[dict]:
    """{(ep, etp): every rank's `rank_expert_tp`} vs one process ({dp: train_reference}): per layout the worst loss
    and parameter difference (each rank's shard of the one-process tensor) and whether every layer's bytes equal
    `theory.experts_tp.layer_comm` for the routing that happened."""
    rows = []
    for (ep, etp), returns in results.items():
        ref = references[len(returns) // etp]
        dl = max(abs(a - b) for r in returns for a, b in zip(r["losses"], ref["losses"]))
        dp_ = 0.0
        for r in returns:
            for name, full in ref["params"].items():
                if ".experts." in name:
                    n, f = full.shape[0] // ep, (full.shape[2] if name.endswith("w2") else full.shape[1]) // etp
                    full = full[r["ep_rank"] * n:(r["ep_rank"] + 1) * n]
                    full = full[:, :, r["etp_rank"] * f:(r["etp_rank"] + 1) * f] if name.endswith("w2") else \
                        full[:, r["etp_rank"] * f:(r["etp_rank"] + 1) * f]
                dp_ = max(dp_, (r["params"][name] - full).abs().max().item())
        same = True
        for r in returns:
            members = sorted((m for m in returns if m["rank"] in r["groups"]["ep"]), key=lambda m: m["ep_rank"])
            for layer, table in enumerate(r["comm"]):
                M = [m["sent"][layer] for m in members]
                same &= table == theory.experts_tp.layer_comm(M, r["ep_rank"], d_model, etp)
        comm = returns[0]["comm"][0]
        rows.append(dict(ep=ep, etp=etp, ranks=len(returns), loss=dl, params=dp_, bytes_equal=same,
                         ops={f"{ph}/{op}": v for (ph, op), v in comm.items()}, groups=returns[0]["groups"]))
    return rows


def expert_tp_table(rows: list[dict], hardware: str) -> str:
    lines = [f"EP x ETP vs one process, 3 SGD steps of the tiny MoE GPT [{hardware}]"]
    for r in rows:
        ops = ", ".join(f"{k}: {v['calls']} x {v['bytes']:,} B" for k, v in sorted(r["ops"].items()))
        lines.append(f"  ep {r['ep']} x etp {r['etp']} on {r['ranks']} ranks: max |loss diff| {r['loss']:.1e}, max "
                     f"|parameter diff| {r['params']:.1e}, bytes = formula: {r['bytes_equal']}\n"
                     f"    rank 0's groups {r['groups']}\n    layer 0 on rank 0: {ops}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ section 11: fine-grained experts

def fine_grained_table(res: dict) -> str:
    head = (f"{'variant':8s} {'routed E':>8s} {'top-k':>5s} {'F':>4s} {'shared F':>8s} "
            f"{'expert params (total/active)':>29s} {'= formula':>9s} {'C(E, k)':>10s} {'held-out loss':>13s} "
            f"{'tokens/expert max/mean':>22s}")
    lines = [f"{res['steps']} AdamW steps on the course's text, the same batches [{res['hardware']}]", head,
             "-" * len(head)]
    for name, v in res["variants"].items():
        s, p, f = v["shape"], v["params"], v["formula"]
        load = v["tokens_per_expert"][0]
        lines.append(f"{name:8s} {s['n_experts']:8d} {s['top_k']:5d} {s['d_ff']:4d} {s['shared_d_ff']:8d} "
                     f"{p['expert_total']:>14,d} / {p['expert_active']:<12,d} "
                     f"{str(p['expert_total'] == f['expert_total'] and p['expert_active'] == f['expert_active']):>9s} "
                     f"{v['combinations']:10,d} {v['eval_loss']:13.3f} "
                     f"{max(load) / (sum(load) / len(load)):22.2f}")
    return "\n".join(lines)


def fine_grained_seeds(runs: dict) -> str:
    """Held-out loss per variant and seed ({seed: `train_variants` result}), the mean and the spread over seeds."""
    names = list(next(iter(runs.values()))["variants"])
    lines = [f"held-out loss (nats) per seed, {len(runs)} seed(s) [{next(iter(runs.values()))['hardware']}]"]
    for name in names:
        vals = [r["variants"][name]["eval_loss"] for r in runs.values()]
        mean = sum(vals) / len(vals)
        spread = max(vals) - min(vals)
        lines.append(f"  {name:8s} " + "  ".join(f"{v:.3f}" for v in vals)
                     + f"   mean {mean:.3f}, max - min {spread:.3f}")
    return "\n".join(lines)


def fine_grained_figure(res: dict, window: int = 20):
    """Training loss (moving average over `window` steps) of the three variants."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    for name, v in res["variants"].items():
        loss = torch.tensor(v["loss"])
        smooth = loss.unfold(0, window, 1).mean(1) if len(loss) >= window else loss
        ax.plot(range(len(loss) - len(smooth), len(loss)), smooth.tolist(), label=f"{name} (held-out "
                f"{v['eval_loss']:.3f})")
    ax.set(xlabel="step", ylabel=f"training loss, mean of {window} steps (nats)")
    ax.set_title(f"Equal expert parameters, total and active [{res['hardware']}]", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
