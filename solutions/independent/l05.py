"""Lesson 05's coding exercises answered independently: written from exercises/05_zero_fsdp_deepspeed.ipynb and the lesson's text,
without reading the official solution or the course's implementation (see README.md beside this file)."""


ANSWERS = {
    '05-memory-formula': (
        'def zero_memory(P: int, N: int, stage: int, mixed: bool = True) -> dict:\n'
        "    '''Model-state bytes per rank of Adam training under ZeRO `stage` (0-3) on N ranks (lesson 05).'''\n"
        '    if mixed:\n'
        '        per_param, per_grad, per_opt = 2.0, 2.0, 12.0      # bf16 weights, bf16 grads, fp32 master + 2 moments\n'
        '    else:\n'
        '        per_param, per_grad, per_opt = 4.0, 4.0, 8.0       # fp32 weights and grads, 2 fp32 moments\n'
        '    # stage s shards the first s of (optimizer, grads, params)\n'
        '    opt_div = N if stage >= 1 else 1\n'
        '    grad_div = N if stage >= 2 else 1\n'
        '    param_div = N if stage >= 3 else 1\n'
        '    params = per_param * P / param_div\n'
        '    grads = per_grad * P / grad_div\n'
        '    optimizer = per_opt * P / opt_div\n'
        '    return dict(params=params, grads=grads, optimizer=optimizer, total=params + grads + optimizer)\n'
    ),
    '05-zero1': (
        'def zero1_step(flat_grad: torch.Tensor, shard: torch.nn.Parameter, optimizer: torch.optim.Optimizer,\n'
        '               group=None) -> torch.Tensor:\n'
        "    '''ZeRO-1 (lesson 05): flat_grad (N*S,) this rank's gradient; shard (S,) its master slice -> (N*S,) new weights.'''\n"
        '    world, rank = dist.get_world_size(group), dist.get_rank(group)\n'
        '    S = shard.numel()\n'
        '    # 1. the mean gradient over ranks, on every rank\n'
        '    mean_grad = flat_grad.detach().clone()\n'
        '    dist.all_reduce(mean_grad, op=dist.ReduceOp.SUM, group=group)\n'
        '    mean_grad.div_(world)\n'
        "    # 2. this rank's slice goes to its shard\n"
        '    shard.grad = mean_grad[rank * S:(rank + 1) * S].clone().to(shard.dtype)\n'
        '    # 3. only the shard moves\n'
        '    optimizer.step()\n'
        "    # 4. everyone gets everyone's updated slice\n"
        '    gathered = torch.empty(world * S, dtype=shard.dtype, device=shard.device)\n'
        '    dist.all_gather_into_tensor(gathered, shard.detach().contiguous(), group=group)\n'
        '    return gathered\n'
    ),
    '05-zero2-grad': (
        'def grad_shard(flat_grad: torch.Tensor, group=None) -> torch.Tensor:\n'
        "    '''ZeRO-2 (lesson 05): (N*S,) this rank's gradient -> (S,) mean over ranks of chunk `rank`.'''\n"
        '    world = dist.get_world_size(group)\n'
        '    S = flat_grad.numel() // world\n'
        '    mine = torch.empty(S, dtype=flat_grad.dtype, device=flat_grad.device)\n'
        '    dist.reduce_scatter_tensor(mine, flat_grad.detach().contiguous(), op=dist.ReduceOp.SUM, group=group)\n'
        '    return mine / world\n'
    ),
    '05-zero3-gather': (
        'def gather_param(param: torch.nn.Parameter, chunk: torch.Tensor, group=None) -> None:\n'
        "    '''ZeRO-3 (lesson 05): chunk (c,) of this rank -> param filled in full (storage restored if freed).'''\n"
        '    world = dist.get_world_size(group)\n'
        '    full = torch.empty(world * chunk.numel(), dtype=chunk.dtype, device=chunk.device)\n'
        '    dist.all_gather_into_tensor(full, chunk.detach().contiguous(), group=group)\n'
        '    n = param.numel()\n'
        '    storage = param.data.untyped_storage()\n'
        '    needed = n * param.element_size()\n'
        '    if storage.nbytes() < needed:\n'
        '        storage.resize_(needed)\n'
        '    with torch.no_grad():\n'
        '        param.data.copy_(full[:n].view(param.shape))\n'
        '\n'
        '\n'
        'def free_param(param: torch.nn.Parameter) -> None:\n'
        "    '''ZeRO-3 (lesson 05): release the full parameter's memory; the tensor object stays.'''\n"
        '    param.data.untyped_storage().resize_(0)\n'
    ),
}
