"""Lesson 10's coding exercises answered independently: written from exercises/10_context_parallel.ipynb and the
lesson's text, without reading the official solution or the course's implementation (see README.md beside this file)."""

ANSWERS = {
    "10-merge-lse": r"""def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    '''Merge two partial attention results over disjoint keys (lesson 10).

    out_a, out_b (B, H, n, D); lse_a, lse_b (B, H, n) -> (out (B, H, n, D), lse (B, H, n)):
    lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.'''
    # stable log(e^a + e^b): shift by the larger of the two; a row at -inf in one block keeps the other's value
    hi = torch.maximum(lse_a, lse_b)
    lo = torch.minimum(lse_a, lse_b)
    lse = hi + torch.log1p(torch.exp(lo - hi))
    lse = torch.where(torch.isneginf(lo), hi, lse)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = w_a * out_a + w_b * out_b
    return out, lse
""",
    "10-balanced-split": r"""def balanced_chunks(cp: int, rank: int) -> list[int]:
    '''The two chunk indices (of 2cp equal chunks) that `rank` holds under a load-balanced causal split.'''
    # query chunk c needs c + 1 key chunks: pairing chunk r with chunk 2cp - 1 - r gives every rank 2cp + 1 pairs
    return [rank, 2 * cp - 1 - rank]


def step_masks(cp: int, rank: int, step: int) -> list[list[str]]:
    '''At ring step `step`, rank `rank` holds the K/V of rank (rank - step) % cp. For each own query chunk (rows)
    and each held key chunk (columns): "full", "causal" or "skip" (lesson 10).'''
    held = balanced_chunks(cp, (rank - step) % cp)
    masks = []
    for qc in balanced_chunks(cp, rank):
        row = []
        for kc in held:
            if kc < qc:
                row.append("full")
            elif kc == qc:
                row.append("causal")
            else:
                row.append("skip")
        masks.append(row)
    return masks
""",
    "10-ring-step": r"""def ring_step(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_start: int,
              kv_start: int, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    '''One ring-attention step on this rank (lesson 10): q (B, H, n, D), kv (2, B, H, n, D), out (B, H, n, D),
    lse (B, H, n) -> (out, lse) merged with this chunk's partial result, and the chunk received from rank r-1.'''
    me = dist.get_rank(group)
    size = dist.get_world_size(group)

    def global_rank(i):
        return i if group is None else dist.get_global_rank(group, i)

    # 1. post both directions of the transfer at once
    send_buf = kv.contiguous()
    recv_buf = torch.empty_like(send_buf)
    ops = [dist.P2POp(dist.isend, send_buf, global_rank((me + 1) % size), group=group),
           dist.P2POp(dist.irecv, recv_buf, global_rank((me - 1) % size), group=group)]
    requests = dist.batch_isend_irecv(ops)

    # 2. attend to the chunk held now, while the next one travels
    n_q, n_k = q.shape[2], kv.shape[3]
    last_query = q_start + n_q - 1
    last_key = kv_start + n_k - 1
    if kv_start <= last_query:                      # some key at or before some query: work to do
        needs_mask = last_key > q_start             # some key after some query: the diagonal
        part_out, part_lse = attend_block(q, kv[0], kv[1], q_start, kv_start, needs_mask)
        # 3. fold it into the running result
        out, lse = merge_lse(out, lse, part_out, part_lse)

    # 4. wait for the next chunk
    for req in requests:
        req.wait()
    return out, lse, recv_buf
""",
    "10-ulysses-reshape": r"""def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    '''Sequence-sharded (B, s/cp, H, D) -> head-sharded (B, s, H/cp, D), one all_to_all_single (lesson 10).'''
    cp = dist.get_world_size(group)
    B, n, H, D = x.shape
    h = H // cp
    # part j of dim 0 = the heads rank j will own, for my tokens
    send = x.reshape(B, n, cp, h, D).permute(2, 0, 1, 3, 4).contiguous()      # (cp, B, n, h, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # part j received = rank j's tokens of my heads: put the token blocks in rank order
    return recv.permute(1, 0, 2, 3, 4).reshape(B, cp * n, h, D)


def heads_to_seq(y: torch.Tensor, group=None) -> torch.Tensor:
    '''Head-sharded (B, s, H/cp, D) -> sequence-sharded (B, s/cp, H, D), one all_to_all_single (lesson 10).'''
    cp = dist.get_world_size(group)
    B, s, h, D = y.shape
    n = s // cp
    # part j of dim 0 = the tokens rank j owns, for my heads
    send = y.reshape(B, cp, n, h, D).permute(1, 0, 2, 3, 4).contiguous()      # (cp, B, n, h, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # part j received = my tokens of rank j's heads: head groups in rank order
    return recv.permute(1, 2, 0, 3, 4).reshape(B, n, cp * h, D)
""",
    "10-document-mask": r"""def document_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, doc_lens: list[int]) -> torch.Tensor:
    '''Which keys each query may attend in a packed sequence (lesson 10, section 7).

    q_pos (nq,), k_pos (nk,): global positions (int64, any order); doc_lens: the documents' lengths in order.
    -> bool (nq, nk): True where the key is in the query's document and not after it.'''
    # label every position with its document: the number of document ends at or before it
    ends = torch.cumsum(torch.tensor(doc_lens, dtype=torch.long, device=q_pos.device), dim=0)
    q_doc = torch.bucketize(q_pos, ends, right=True)
    k_doc = torch.bucketize(k_pos.to(q_pos.device), ends, right=True)
    same_doc = q_doc.unsqueeze(1) == k_doc.unsqueeze(0)
    not_later = k_pos.to(q_pos.device).unsqueeze(0) <= q_pos.unsqueeze(1)
    return same_doc & not_later


def document_rows(doc_lens: list[int], cp: int, rank: int) -> list[int]:
    '''The global positions `rank` holds so that every rank has the same attention work under the document mask.'''
    # inside a document of length L, offset t sees t + 1 keys, so offsets t and L - 1 - t together see L + 1:
    # deal the L / 2 such pairs round-robin, and every rank gets L / (2 cp) pairs of every document
    rows = []
    start = 0
    for length in doc_lens:
        for t in range(rank, length // 2, cp):
            rows.append(start + t)
            rows.append(start + length - 1 - t)
        start += length
    return rows
""",
}
