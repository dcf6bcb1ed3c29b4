"""Lesson 00's coding exercises answered independently: written from exercises/00_getting_started.ipynb and the
lesson's text, without reading the official solution or the course's implementation (see README.md beside this file)."""

ANSWERS = {
    "00-partial-sum": (
        "def partial_sum(n: int, rank: int, world_size: int) -> int:\n"
        "    '''Sum of rank `rank`'s contiguous chunk of 1..n (lesson 00).\n"
        "\n"
        "    The first n % world_size ranks get floor(n / world_size) + 1 numbers, the others floor(n / world_size).\n"
        "    Summed over all ranks the partial sums give n * (n + 1) // 2.\n"
        "    '''\n"
        "    base, extra = divmod(n, world_size)\n"
        "    # numbers before this rank's chunk: base per earlier rank, plus one for each earlier rank below `extra`\n"
        "    first = rank * base + min(rank, extra) + 1\n"
        "    size = base + (1 if rank < extra else 0)\n"
        "    last = first + size - 1\n"
        "    if size <= 0:\n"
        "        return 0\n"
        "    # arithmetic series first..last\n"
        "    return (first + last) * size // 2\n"
        "\n"
        "\n"
        "print([partial_sum(10, r, 3) for r in range(3)])  # chunks 1..4, 5..7, 8..10\n"
    ),
    "00-distributed-sum": (
        "def sum_on_rank(n: int) -> int:\n"
        "    '''Runs on every rank: this rank's partial sum, all-reduced so that every rank returns n(n+1)/2.'''\n"
        "    import torch\n"
        "    import torch.distributed as dist\n"
        "    from course_lib import dist as cdist\n"
        "\n"
        "    mine = partial_sum(n, cdist.rank(), cdist.world_size())\n"
        "    # int64 keeps totals above 2**31 exact; the tensor lives where this rank's backend expects it\n"
        "    buf = torch.tensor([mine], dtype=torch.int64, device=cdist.device())\n"
        "    dist.all_reduce(buf, op=dist.ReduceOp.SUM)\n"
        "    return int(buf.item())\n"
    ),
}
