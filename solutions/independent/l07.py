"""Lesson 07's coding exercises answered independently: written from exercises/07_memory_savers.ipynb and the lesson's text,
without reading the official solution or the course's implementation (see README.md beside this file)."""

ANSWERS = {
    '07-checkpoint-block': (
        'class CheckpointedBlock(nn.Module):\n'
        '    """A transformer block run under full activation checkpointing (lesson 07): (B, T, C) -> (B, T, C)."""\n'
        '\n'
        '    def __init__(self, block: nn.Module):\n'
        '        super().__init__()\n'
        '        self.block = block\n'
        '\n'
        '    def forward(self, x: torch.Tensor) -> torch.Tensor:\n'
        '        if not torch.is_grad_enabled():\n'
        '            return self.block(x)             # nothing will be backpropagated: no need to recompute\n'
        '        return checkpoint(self.block, x, use_reentrant=False)\n'
    ),
    '07-activation-estimator': (
        'def estimate_activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, every: int | None = None,\n'
        '                              attention: str = "sdpa") -> float:\n'
        '    """Bytes a GPT\'s forward keeps for backward, fp32 (lesson 07)."""\n'
        '    fp32 = 4\n'
        '    tokens = batch_size * seq_len\n'
        '    C, F, H, L = cfg.d_model, cfg.d_ff, cfg.n_head, cfg.n_layer\n'
        '    if every is not None:\n'
        '        if every < 1:\n'
        '            raise ValueError(f"every={every} must be a positive number of blocks")\n'
        '        segments = -(-L // every)\n'
        '        blocks = segments * tokens * C * fp32\n'
        '    else:\n'
        '        if attention == "sdpa":\n'
        '            attn_extra = H                   # one log-sum-exp per head and token\n'
        '        elif attention == "naive":\n'
        '            attn_extra = H * seq_len         # the softmax row of every head\n'
        '        else:\n'
        '            raise ValueError(f"attention={attention!r}: \'sdpa\' or \'naive\'")\n'
        '        per_token = (8 * C + 2 * F) + 4 + attn_extra\n'
        '        blocks = L * tokens * per_token * fp32\n'
        '    other = theory.memory.activation_bytes(cfg, batch_size, seq_len)["other"]\n'
        '    return float(blocks + other)\n'
    ),
    '07-budget-fitter': (
        'def fit_budget(budget_bytes: float, candidates: list, global_batch: int, everys=(None, 1, 2, 4)) -> dict | None:\n'
        '    """The largest model that fits `budget_bytes`, with its cheapest plan (lesson 07)."""\n'
        '    micro_batches = [b for b in range(1, global_batch + 1) if global_batch % b == 0]\n'
        '    by_size = sorted(candidates, key=lambda c: c.num_params(), reverse=True)\n'
        '    for cfg in by_size:\n'
        '        fitting = []\n'
        '        for every in everys:\n'
        '            for mb in micro_batches:\n'
        '                nbytes = theory.savers.plan_bytes(cfg, mb, every)["total"]\n'
        '                if nbytes <= budget_bytes:\n'
        '                    fitting.append((every is not None, -mb, nbytes, mb, every))\n'
        '        if fitting:\n'
        '            _, _, nbytes, mb, every = min(fitting, key=lambda t: t[:3])\n'
        '            return dict(name=cfg.name, micro_batch=mb, accum_steps=global_batch // mb, every=every, bytes=nbytes)\n'
        '    return None\n'
    ),
    # 07-quiz is a quiz, not a coding exercise: left out.
}
