"""Lesson 03's coding exercises answered independently: written from exercises/03_pipeline_parallel.ipynb and the lesson's text,
without reading the official solution or the course's implementation (see README.md beside this file)."""


ANSWERS = {
    '03-split-stages': (
        'def split_stages(n_layers: int, p: int) -> list[tuple[int, int]]:\n'
        "    '''Contiguous block ranges [start, end) for p stages; sizes differ by at most one, larger ones first.'''\n"
        '    base, extra = divmod(n_layers, p)\n'
        '    ranges = []\n'
        '    start = 0\n'
        '    for s in range(p):\n'
        '        size = base + (1 if s < extra else 0)\n'
        '        ranges.append((start, start + size))\n'
        '        start += size\n'
        '    return ranges\n'
    ),
    '03-gpipe': (
        'def gpipe_step(stage, x_mbs, y_mbs, comm) -> list[float]:\n'
        "    '''One GPipe forward/backward on this rank; returns the m micro-batch losses on the last stage, else [].'''\n"
        '    m = len(x_mbs)\n'
        '    b, T = x_mbs[0].shape\n'
        '    saved = []          # (input, output or scaled loss) per micro-batch\n'
        '    losses = []\n'
        '    for i in range(m):\n'
        '        if stage.is_first:\n'
        '            inp = x_mbs[i]\n'
        '        else:\n'
        '            inp = comm.recv_forward((b, T, stage.d_model)).requires_grad_()\n'
        '        out = stage(inp)\n'
        '        if stage.is_last:\n'
        '            loss = lm_loss(out, y_mbs[i])\n'
        '            losses.append(loss.item())\n'
        '            saved.append((inp, loss / m))\n'
        '        else:\n'
        '            comm.send_forward(out)\n'
        '            saved.append((inp, out))\n'
        '    for i in range(m):\n'
        '        inp, out = saved[i]\n'
        '        if stage.is_last:\n'
        '            out.backward()\n'
        '        else:\n'
        '            grad_out = comm.recv_backward(out.shape)\n'
        '            torch.autograd.backward(out, grad_out)\n'
        '        if not stage.is_first:\n'
        '            comm.send_backward(inp.grad)\n'
        '    comm.wait_all()\n'
        '    return losses if stage.is_last else []\n'
    ),
    '03-1f1b-order': (
        'def one_f_one_b_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:\n'
        "    '''1F1B ops of rank `rank` in a p-stage pipeline with m micro-batches: warm-up, steady (F, B) pairs, cool-down.'''\n"
        '    warm = min(p - rank - 1, m)\n'
        '    ops = [("F", i) for i in range(warm)]\n'
        '    for k in range(m - warm):\n'
        '        ops.append(("F", warm + k))\n'
        '        ops.append(("B", k))\n'
        '    ops.extend(("B", i) for i in range(m - warm, m))\n'
        '    return ops\n'
    ),
    '03-interleaved-order': (
        'def interleaved_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:\n'
        '    \'\'\'Interleaved 1F1B ops ("F"|"B", micro_batch, chunk) of rank `rank`: p ranks, v chunks each, m micro-batches\n'
        "    (m a multiple of p), obeying the exercise's four rules: all the work, dependencies, bubble, memory cap.'''\n"
        '    total = v * m                      # chunk-forwards (and chunk-backwards) this rank runs\n'
        '\n'
        '    def unit(k, backward):\n'
        '        # micro-batches go through the chunks in groups of p: p forwards of chunk 0, p of chunk 1, ...\n'
        '        group, pos = divmod(k, p * v)\n'
        '        chunk = pos // p\n'
        '        if backward:\n'
        '            chunk = v - 1 - chunk      # backwards walk the chunks the other way\n'
        '        return group * p + pos % p, chunk\n'
        '\n'
        '    if m == p:\n'
        '        warm = total                   # every forward first, then every backward\n'
        '    else:\n'
        '        warm = min(2 * (p - rank - 1) + (v - 1) * p, total)\n'
        '    ops = [("F", *unit(k, False)) for k in range(warm)]\n'
        '    for k in range(total - warm):\n'
        '        ops.append(("F", *unit(warm + k, False)))\n'
        '        ops.append(("B", *unit(k, True)))\n'
        '    ops.extend(("B", *unit(k, True)) for k in range(total - warm, total))\n'
        '    return ops\n'
    ),
    '03-bubble': (
        'def bubble_fraction(p: int, m: int) -> float:\n'
        "    '''Idle fraction of a GPipe / 1F1B step with p stages and m micro-batches.'''\n"
        '    step = m + p - 1                   # in units of (t_f + t_b)\n'
        '    busy = m\n'
        '    return (step - busy) / step\n'
    ),
}
