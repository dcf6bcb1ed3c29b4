"""Tables and figures of lesson 11 (notebooks/11_mixture_of_experts.ipynb)."""

from __future__ import annotations

from course_lib import theory

__all__ = ["load_figure", "dropped_table", "dropped_figure", "comm_rows", "comm_figure", "rank_loads", "mesh_table",
           "mesh_figure", "equality"]


def load_figure(runs: dict, hardware: str):
    """Max / mean tokens per expert over training, one line per balancing method."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for (method, r), color in zip(runs.items(), ("C0", "C1", "C2", "C3")):
        ax.plot(r["load"], label=method, color=color)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="max / mean tokens per expert", title=f"expert load over training\n[{hardware}]")
    ax.legend()
    fig.tight_layout()
    return fig


def dropped_table(drops: dict, hardware: str) -> str:
    lines = [f"{'method':8s} " + " ".join(f"cf={d['cf']:<5} " for d in next(iter(drops.values()))) + f"  [{hardware}]"]
    for method, rows in drops.items():
        lines.append(f"{method:8s} " + " ".join(f"{d['fraction'] * 100:5.1f} % " for d in rows))
    return "\n".join(lines)


def dropped_figure(drops: dict, hardware: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for (method, rows), color in zip(drops.items(), ("C0", "C1", "C2", "C3")):
        ax.plot([d["cf"] for d in rows], [100 * d["fraction"] for d in rows], "o-", label=method, color=color)
    ax.set(xlabel="capacity factor", ylabel="assignments dropped (%)", title=f"dropped tokens, last step\n[{hardware}]")
    ax.legend()
    fig.tight_layout()
    return fig


def comm_rows(returns: list, key: str, d_model: int) -> list[dict]:
    """Layer 0 of every rank: counted bytes per (phase, op) vs `theory.experts.layer_comm` for the routing that
    happened, and bytes leaving the rank (`bytes_leaving`)."""
    M = [res[key]["sent"][0] for res in returns]
    rows = []
    for r, res in enumerate(returns):
        counted, formula = res[key]["comm"][0], theory.experts.layer_comm(M, r, d_model)
        rows.append(dict(rank=r, counted=counted, formula=formula, equal=counted == formula,
                         dispatch=counted[("forward", "dispatch")]["bytes"],
                         leaving=theory.experts.bytes_leaving(M, r, d_model)))
    return rows


def comm_figure(rows_by_world: dict, hardware: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    x = 0
    for world, rows in rows_by_world.items():
        for row in rows:
            ax.bar(x, row["dispatch"], color="C0", label="dispatch payload" if x == 0 else None)
            ax.bar(x + 0.4, row["leaving"], width=0.4, color="C1", label="leaving the rank" if x == 0 else None)
            ax.text(x + 0.2, 0, f"ep{world}\nr{row['rank']}", ha="center", va="bottom", fontsize=7)
            x += 1.2
    ax.set(ylabel="bytes, layer 0, forward", title=f"all-to-all bytes per rank (counted = formula)\n[{hardware}]")
    ax.set_xticks([])
    ax.legend()
    fig.tight_layout()
    return fig


def rank_loads(returns: list, n_experts: int) -> list[int]:
    """Rows each ep rank's experts received in layer 0 (from every rank's sent counts)."""
    P = len(returns)
    n = n_experts // P
    M = [res["skewed"]["sent"][0] for res in returns]
    return [sum(M[s][e] for s in range(P) for e in range(r * n, (r + 1) * n)) for r in range(P)]


def mesh_table(returns: list, key: str) -> str:
    """Which rank holds which experts and which ranks average which gradients."""
    lines = ["rank  experts held   averages dense grads over   averages expert grads over (expert-dp)   ep group"]
    for r, res in enumerate(returns):
        row = res[key]
        lines.append(f"{r:4d}  {str(row['experts']):13s}  {str(row['dp_ranks']):26s}  {str(row['edp_ranks']):40s}"
                     f"{row['ep_ranks']}")
    return "\n".join(lines)


def mesh_figure(returns: list, key: str, hardware: str):
    """The EP mesh as boxes, one per rank: the experts it holds (colour = its place in the ep group, so the ranks
    that share a colour hold the same experts and average their gradients: an expert-dp group), the ranks it averages
    the dense gradients with (dp) and the expert gradients with (expert-dp)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    n = len(returns)
    fig, ax = plt.subplots(figsize=(1.9 * n + 0.6, 3.4))
    colors = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7")
    for r, res in enumerate(returns):
        row = res[key]
        ax.add_patch(FancyBboxPatch((r * 1.9 + 0.1, 0.55), 1.6, 1.9, boxstyle="round,pad=0.03", fc="white",
                                    ec="black", lw=1))
        ax.text(r * 1.9 + 0.9, 2.25, f"rank {r}", ha="center", va="center", fontsize=9, weight="bold")
        for j, e in enumerate(row["experts"]):                       # one small box per expert held
            ax.add_patch(Rectangle((r * 1.9 + 0.25 + j * 0.7, 1.45), 0.6, 0.55, fc=colors[row["ep_rank"]],
                                   alpha=0.55, ec="black"))
            ax.text(r * 1.9 + 0.55 + j * 0.7, 1.72, f"E{e}", ha="center", va="center", fontsize=8)
        ax.text(r * 1.9 + 0.9, 1.1, f"ep group {row['ep_ranks']}", ha="center", va="center", fontsize=7)
        ax.text(r * 1.9 + 0.9, 0.8, f"expert-dp {row['edp_ranks']}", ha="center", va="center", fontsize=7,
                color=colors[row["ep_rank"]])
    dp = returns[0][key]["dp_ranks"]
    ax.annotate("", xy=(n * 1.9 - 0.1, 0.3), xytext=(0.1, 0.3), arrowprops=dict(arrowstyle="<->", color="grey"))
    ax.text(n * 1.9 / 2, 0.12, f"dense gradients (attention, router, embeddings): averaged over dp {len(dp)} = {dp}",
            ha="center", va="center", fontsize=7, color="grey")
    ax.set(xlim=(0, n * 1.9), ylim=(0, 2.6), title=f"the EP mesh: {key}, {n} ranks; same colour = same experts "
           f"(an expert-dp group)\n[{hardware}]")
    ax.axis("off")
    fig.tight_layout()
    return fig


def equality(returns: list, ref: dict, key: str, ep: int) -> dict:
    """max |loss diff| over steps and max |first gradient diff| (expert gradients against this rank's shard)."""
    loss = grad = 0.0
    for res in returns:
        row = res[key]
        loss = max(loss, max(abs(a - b) for a, b in zip(row["losses"], ref["losses"])))
        for name, full in ref["first_grads"].items():
            if ".experts." in name:
                n = full.shape[0] // ep
                full = full[row["ep_rank"] * n:(row["ep_rank"] + 1) * n]
            grad = max(grad, (row["first_grads"][name] - full).abs().max().item())
    return dict(loss=loss, grad=grad)
