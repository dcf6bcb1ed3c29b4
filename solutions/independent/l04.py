"""Lesson 04's coding exercises answered independently: written from exercises/04_tensor_parallel.ipynb and the lesson's text,
without reading the official solution or the course's implementation (see README.md beside this file)."""

# The student copy puts the answers of two exercises in one span each: the cells of f/ColumnParallel and of
# g/RowParallel both come before 04-column-parallel's test cell, and those of ParallelMLP and
# vocab_parallel_cross_entropy both before 04-parallel-mlp's. So 04-row-parallel and 04-vocab-ce have no stub
# cell of their own and are left out here: their answers are in 04-column-parallel's and 04-parallel-mlp's.

ANSWERS = {
    '04-column-parallel': (
        'class CopyToTP(torch.autograd.Function):\n'
        "    '''f: identity forward, all-reduce (sum over the ranks of `group`) backward (Megatron-LM, Shoeybi et al. 2019).'''\n"
        '\n'
        '    @staticmethod\n'
        '    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:\n'
        '        ctx.group = group\n'
        '        return x.view_as(x)\n'
        '\n'
        '    @staticmethod\n'
        '    def backward(ctx, grad: torch.Tensor):\n'
        '        total = grad.clone()\n'
        '        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)\n'
        '        return total, None\n'
        '\n'
        '\n'
        'class ColumnParallel(nn.Module):\n'
        "    '''This rank's output features of `full` (lesson 04): weight (out/t, in), bias (out/t).\n"
        '\n'
        '    forward: x (B, T, in), the same on every rank -> (B, T, out/t) = f(x) W_r^T + b_r.\n'
        "    '''\n"
        '\n'
        '    def __init__(self, full: nn.Linear, group=None):\n'
        '        super().__init__()\n'
        '        self.group = group\n'
        '        tp, r = dist.get_world_size(group), dist.get_rank(group)\n'
        '        rows = full.out_features // tp\n'
        '        lo, hi = r * rows, (r + 1) * rows\n'
        '        self.weight = nn.Parameter(full.weight.detach()[lo:hi, :].clone())\n'
        '        if full.bias is not None:\n'
        '            self.bias = nn.Parameter(full.bias.detach()[lo:hi].clone())\n'
        '        else:\n'
        '            self.register_parameter("bias", None)\n'
        '\n'
        '    def forward(self, x: torch.Tensor) -> torch.Tensor:\n'
        '        return F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)\n'
        '\n'
        'class ReduceFromTP(torch.autograd.Function):\n'
        "    '''g: all-reduce (sum over the ranks of `group`) forward, identity backward.'''\n"
        '\n'
        '    @staticmethod\n'
        '    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:\n'
        '        total = x.clone()\n'
        '        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)\n'
        '        return total\n'
        '\n'
        '    @staticmethod\n'
        '    def backward(ctx, grad: torch.Tensor):\n'
        '        return grad, None\n'
        '\n'
        '\n'
        'class RowParallel(nn.Module):\n'
        "    '''This rank's input features of `full` (lesson 04): weight (out, in/t), bias (out,) whole.\n"
        '\n'
        "    forward: x (B, T, in/t), this rank's slice -> (B, T, out) = g(x W_r^T) + b, the same on every rank.\n"
        "    '''\n"
        '\n'
        '    def __init__(self, full: nn.Linear, group=None):\n'
        '        super().__init__()\n'
        '        self.group = group\n'
        '        tp, r = dist.get_world_size(group), dist.get_rank(group)\n'
        '        cols = full.in_features // tp\n'
        '        self.weight = nn.Parameter(full.weight.detach()[:, r * cols:(r + 1) * cols].clone())\n'
        '        if full.bias is not None:\n'
        '            self.bias = nn.Parameter(full.bias.detach().clone())\n'
        '        else:\n'
        '            self.register_parameter("bias", None)\n'
        '\n'
        '    def forward(self, x: torch.Tensor) -> torch.Tensor:\n'
        '        partial = F.linear(x, self.weight)\n'
        '        y = ReduceFromTP.apply(partial, self.group)\n'
        '        if self.bias is not None:\n'
        '            y = y + self.bias\n'
        '        return y\n'
    ),
    '04-parallel-mlp': (
        'class ParallelMLP(nn.Module):\n'
        "    '''Tensor-parallel MLP built from a full course_lib.model.MLP (lesson 04): x (B, T, C) -> (B, T, C).'''\n"
        '\n'
        '    def __init__(self, mlp: nn.Module, group=None):\n'
        '        super().__init__()\n'
        '        self.fc = ColumnParallel(mlp.fc, group)       # C -> F/t on this rank\n'
        '        self.proj = RowParallel(mlp.proj, group)      # F/t -> C, summed over ranks\n'
        '        self.drop = getattr(mlp, "drop", nn.Identity())\n'
        '\n'
        '    def forward(self, x: torch.Tensor) -> torch.Tensor:\n'
        '        hidden = F.gelu(self.fc(x), approximate="tanh")\n'
        '        return self.drop(self.proj(hidden))\n'
        '\n'
        'def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:\n'
        "    '''Mean cross-entropy of logits split along the vocabulary (lesson 04; Megatron-LM).\n"
        '\n'
        '    local_logits (B, T, V/t): columns [r V/t, (r+1) V/t) of the logits; targets (B, T) global ids -> a 0-d loss.\n'
        "    '''\n"
        '    r = dist.get_rank(group)\n'
        '    z = local_logits.float().flatten(0, 1)                 # (N, V/t)\n'
        '    t = targets.flatten()                                  # (N,)\n'
        '    start, end = r * z.shape[-1], (r + 1) * z.shape[-1]    # the ids this rank owns\n'
        '    # the global max per token: a constant for autograd, so work on a detached copy\n'
        '    top = z.detach().max(dim=-1).values\n'
        '    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)\n'
        '    shifted = z - top.unsqueeze(-1)\n'
        '    # sum of exponentials over the whole vocabulary: local sums, added across ranks\n'
        '    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)\n'
        "    # the target's shifted logit: only its owner contributes, the others add 0\n"
        '    mine = (t >= start) & (t < end)\n'
        '    local_idx = torch.where(mine, t - start, torch.zeros_like(t))\n'
        '    picked = shifted.gather(1, local_idx.unsqueeze(1)).squeeze(1)\n'
        '    picked = torch.where(mine, picked, torch.zeros_like(picked))\n'
        '    target_logit = reduce_from_tp(picked, group)\n'
        '    return (torch.log(sum_exp) - target_logit).mean()\n'
    ),
}
