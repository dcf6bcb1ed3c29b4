"""Lesson 09's coding exercises answered independently: written from exercises/09_training_in_practice.ipynb and the
lesson's text, without reading the official solution or the course's implementation (see README.md beside this file)."""

ANSWERS = {
    "09-schedule": r'''def warmup_cosine_lr(step: int, peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """Learning rate of optimizer update `step` (0-based): linear warm-up, cosine to min_lr, then min_lr (lesson 09)."""
    peak_step = max(warmup_steps, 1) - 1
    if step >= total_steps:
        return min_lr
    if step < peak_step:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - peak_step) / (total_steps - peak_step)
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
''',
    "09-global-norm": r'''def clip_global_grad_norm_(sharded: list, replicated: list, tp_group, max_norm: float) -> torch.Tensor:
    """Global 2-norm of the gradient (sharded parts summed over tp_group, replicated ones once); clip in place."""
    def grads(items):
        out = []
        for item in items:
            g = item.grad if isinstance(item, torch.nn.Parameter) else item
            if g is not None:
                out.append(g)
        return out

    shard_grads, rep_grads = grads(sharded), grads(replicated)
    everything = shard_grads + rep_grads
    device = everything[0].device if everything else torch.device("cpu")

    # squares of this rank's slices, summed with the other TP ranks' slices
    shard_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in shard_grads:
        shard_sq += g.detach().float().pow(2).sum()
    dist.all_reduce(shard_sq, op=dist.ReduceOp.SUM, group=tp_group)

    # replicated parts: the same everywhere, counted once
    rep_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in rep_grads:
        rep_sq += g.detach().float().pow(2).sum()

    total_norm = (shard_sq + rep_sq).sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in everything:
        g.detach().mul_(scale.to(g.dtype))
    return total_norm
''',
    "09-alert-rule": r'''class DurationRule:
    """`value op threshold` held for `for_s` seconds of samples: fire once per episode (lesson 09)."""

    def __init__(self, op: str, threshold: float, for_s: float):
        self.op, self.threshold, self.for_s = op, threshold, for_s
        if op not in (">", "<"):
            raise ValueError(f"op must be '>' or '<', not {op!r}")
        self.since = None        # start time of the current episode, None outside one
        self.fired = False       # whether the current episode has already fired

    def observe(self, t: float, value: float) -> bool:
        """Feed one sample; True when the rule fires at it."""
        if value != value:       # NaN: neither holds nor breaks the episode
            return False
        holds = value > self.threshold if self.op == ">" else value < self.threshold
        if not holds:
            self.since, self.fired = None, False
            return False
        if self.since is None:
            self.since = t
        if not self.fired and t - self.since >= self.for_s:
            self.fired = True
            return True
        return False
''',
    "09-resume": r'''def save_checkpoint(folder: str, *, model, optimizer, scheduler, step: int, data_position: int) -> None:
    """Write everything needed to continue the run exactly into the folder `folder` (lesson 09)."""
    os.makedirs(folder, exist_ok=True)
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, os.path.join(folder, "state.pt"))
    torch.save({"rng": rng, "step": step, "data_position": data_position}, os.path.join(folder, "progress.pt"))


def load_checkpoint(folder: str, *, model, optimizer, scheduler) -> tuple[int, int]:
    """Restore what `save_checkpoint` wrote; return (step, data_position) (lesson 09)."""
    state = torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=False)
    progress = torch.load(os.path.join(folder, "progress.pt"), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = progress["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    torch.set_rng_state(rng["torch"])
    return int(progress["step"]), int(progress["data_position"])
''',
    "09-spike-detector": r'''class SpikeDetector:
    """z-score loss-spike detector over a sliding window of accepted values (lesson 09)."""

    def __init__(self, window: int = 20, warmup: int = 10, z: float = 6.0):
        self.window, self.warmup, self.z = window, warmup, z
        self.values = collections.deque(maxlen=window)   # the last accepted values
        self.accepted = 0                                 # how many values were accepted in all

    def update(self, value: float) -> bool:
        """Judge one value; True when it is a spike (a spike is not added to the window)."""
        value = float(value)
        if not math.isfinite(value):
            return True
        if self.accepted >= self.warmup:
            n = len(self.values)
            mean = sum(self.values) / n
            var = sum((v - mean) ** 2 for v in self.values) / (n - 1)
            std = math.sqrt(var)
            if std > 0:
                spike = (value - mean) / std > self.z
            else:
                spike = value > mean
            if spike:
                return True
        self.values.append(value)
        self.accepted += 1
        return False
''',
}
