"""The techniques of the course, one per file, each applied to a plain `course_lib.model.GPT`.

    collectives.py         ring all-reduce from send/recv, bytes counted                     lesson 02
    ddp.py                 naive gradient averaging, bucketed DDP overlapped with backward   lesson 02
    pipeline_schedules.py  GPipe, 1F1B, interleaved 1F1B, ZB-H1 orders; simulated; bubble    lesson 03
    pipeline_messages.py   a schedule's point-to-point posts, in an order NCCL cannot deadlock lesson 03
    split_backward.py      zero-bubble's backward split: B (input gradient) now, W later      lesson 03
    pipeline.py            a GPT split into stages (or v chunks per rank), a schedule run    lesson 03
    tensor.py              column/row-parallel linear, f and g, parallel MLP and attention   lesson 04
    sequence.py            sequence parallelism: collectives along the sequence              lesson 04
    vocab.py               vocab-parallel embedding and cross-entropy                        lesson 04
    tensor_model.py        apply_tensor_parallel: a whole GPT tensor (+ sequence) parallel   lesson 04
    tensor_dtensor.py      the same with PyTorch DTensor's parallelize_module                lesson 04
    sharded_module.py      ZeRO-3 shaped like FSDP2: shard_module, any optimizer, a policy  lesson 05
    sharded_state.py       shards as DCP pieces of full-length tensors (any world size)     lessons 05, 09
    zero.py                ZeRO stages 1-3 (apply_zero / ZeroOptimizer; 3 = shard_module)    lesson 05
    zero_state.py          what ZeroOptimizer holds: its shard's state dict, the DCP form    lessons 05, 09
    precision.py           number formats, dynamic loss scaling, fp32 master weights         lesson 06
    checkpointing.py       activation checkpointing, full and selective                      lesson 07
    three_d.py             data x pipeline x tensor parallel on one process grid             lesson 08
    three_d_torch.py       the same with DeviceMesh, DTensor, FSDP2 and torch pipelining     lesson 08
    schedules.py           learning-rate warm-up, cosine decay, layer-wise rates             lesson 09
    clipping.py            global gradient-norm clipping across replicas and shards          lesson 09
    dist_checkpoint.py     distributed checkpoints (DCP, DeepSpeed): bit-exact resume        lesson 09
    deepspeed_config.py    DeepSpeed configs in the syllabus's style, imported for this machine lessons 05-07, 09
    block_attention.py     blockwise attention with the online softmax, one process          lesson 10
    context_attention.py   attention over a sequence split across cp ranks: ring, all-gather, Ulysses  lesson 10
    context.py             context parallelism applied to a plain GPT                        lesson 10
    context_documents.py   packed documents: document-masked all-gather CP, per-document balance  lesson 10
    context_hybrid.py      hybrid CP: Ulysses inside groups of u ranks, the ring across       lesson 10
    moe.py                 a mixture-of-experts layer in one process: router, dispatch, combine lesson 11
    experts.py             expert parallelism: experts sharded over ep ranks, all-to-all     lesson 11
    experts_tp.py          expert tensor parallelism, EP x ETP: each expert's MLP over etp ranks  lesson 11
    moe_grouped.py         dropless experts on grouped GEMMs; router z-loss, fp32 router      lesson 11
    moe_node_limited.py    node-limited routing (DeepSeek-V3) and its dispatch bytes          lesson 11
    float8.py              FP8 from scratch: scales, saturating casts, a linear in FP8        lesson 12
    fast_step.py           one device at full speed: optimizer implementations, compile, switches lessons 01, 12

May import: the core (``course_lib``'s root modules), `course_lib.measure` (counters, timers, hardware facts),
`course_lib.theory` and itself; never the launcher, the training script, grading or the lessons (tests/test_layout.py):
the lessons' experiments, graded checks and reports live in `course_lib.lessons`, one folder per lesson.
"""
