"""The course's one English / Chinese glossary: every lesson's glossary table is generated from :data:`TERMS`.

A lesson's last markdown cell holds ``## Glossary (English / 中文)`` and a table whose English column lists the
terms it uses; ``course build`` fills in the Chinese column from here (in ``notebooks/``, ``solutions/`` and the
generated ``exercises/``) and writes ``docs/GLOSSARY.md``, and a test fails when a table differs from what this
module generates. A row may join terms with `` / `` ("reduce-scatter / all-gather"): each part is looked up.

    chinese("reduce-scatter / all-gather")   # '归约散射 / 全收集'
    sync_cell(markdown)                      # the cell with its table's Chinese column regenerated
"""

from __future__ import annotations

import re
from pathlib import Path

from course_lib import notebook as nbio

__all__ = ["TERMS", "HEADING", "chinese", "glossary_rows", "sync_cell", "sync_notebook", "document", "sync_course"]

HEADING = "## Glossary (English / 中文)"

# One Chinese rendering per concept. Where sources differ, the course writes 全归约 (not 全规约), 归约散射 (not
# 归约分散) and 进程总数（世界大小）.
TERMS: dict[str, str] = {
    # collectives and launching (lessons 00-02)
    "all-reduce": "全归约",
    "all-gather": "全收集",
    "reduce-scatter": "归约散射",
    "broadcast": "广播",
    "ring all-reduce": "环形全归约",
    "collective communication": "集合通信",
    "point-to-point communication": "点对点通信",
    "point-to-point communication (send/recv)": "点对点通信（send/recv）",
    "process group": "进程组",
    "rank": "进程编号（秩）",
    "world size": "进程总数（世界大小）",
    "rendezvous": "汇合（进程握手）",
    "backend (gloo, NCCL)": "通信后端",
    "launcher (torchrun)": "启动器",
    "timeout": "超时",
    "partial sum": "部分和",
    # bottlenecks (lesson 01)
    "bottleneck": "瓶颈",
    "FLOPs (floating-point operations)": "浮点运算次数",
    "FLOPs per token": "每个词元的浮点运算量",
    "arithmetic intensity": "算术强度",
    "compute-bound": "计算受限",
    "memory-bound": "访存受限",
    "roofline model": "屋顶线模型",
    "peak throughput": "峰值算力",
    "model FLOPs utilisation (MFU)": "模型算力利用率",
    "hardware FLOPs utilisation (HFU)": "硬件算力利用率",
    "model FLOPs": "模型浮点运算量",
    "dense peak": "稠密峰值",
    "sparse peak (2:4 structured sparsity)": "稀疏峰值（2:4 结构化稀疏）",
    "causal mask": "因果掩码",
    "weak scaling": "弱扩展",
    "calibration (of a cost model)": "（代价模型的）校准",
    "tile quantization": "tile 量化效应（矩阵乘分块尾部的浪费）",
    "wave quantization": "波次量化（SM 波次的浪费）",
    "model chunk (virtual pipeline stage)": "模型块（虚拟流水线阶段）",
    "input-gradient pass (B)": "输入梯度计算（B）",
    "weight-gradient pass (W)": "权重梯度计算（W）",
    "V-shaped schedule": "V 形调度",
    "memory bandwidth": "内存带宽（显存带宽）",
    "algorithm bandwidth": "算法带宽",
    "bus bandwidth": "总线带宽",
    "latency": "延迟",
    "profiler": "性能分析器",
    "interconnect": "互连",
    "intra-node": "节点内",
    "inter-node": "节点间",
    "NVLink, InfiniBand": "NVLink 高速互联, InfiniBand 网络",
    "GPU memory": "显存",
    "communication overhead": "通信开销",
    # data parallelism (lesson 02)
    "data parallelism": "数据并行",
    "gradient averaging": "梯度平均",
    "bucket": "梯度桶",
    "overlap of communication and computation": "通信与计算重叠",
    "scaling efficiency": "扩展效率",
    "gradient accumulation": "梯度累积",
    "micro-batch": "微批次",
    "global batch": "全局批次",
    # pipeline (lesson 03)
    "model parallelism": "模型并行",
    "pipeline parallelism": "流水线并行",
    "stage": "阶段（流水线级）",
    "bubble (idle time)": "气泡（空闲时间）",
    "GPipe": "GPipe",
    "1F1B schedule": "1F1B 调度",
    "interleaved schedule": "交错调度",
    "zero-bubble pipeline": "零气泡流水线",
    "warm-up": "预热",
    "steady state": "稳定阶段",
    "cool-down": "冷却",
    "activation memory": "激活显存",
    # tensor parallelism (lesson 04)
    "tensor parallelism": "张量并行",
    "sequence parallelism": "序列并行",
    "column-parallel linear layer": "列并行线性层",
    "row-parallel linear layer": "行并行线性层",
    "conjugate operators f / g": "共轭算子 f / g",
    "vocabulary-parallel embedding": "词表并行嵌入",
    "attention head": "注意力头",
    "cross-entropy": "交叉熵",
    "shard": "分片",
    # ZeRO (lesson 05)
    "Zero Redundancy Optimizer (ZeRO)": "零冗余优化器",
    "fully sharded data parallel (FSDP)": "完全分片数据并行",
    "optimizer state": "优化器状态",
    "optimizer state sharding": "优化器状态分片",
    "gradient sharding": "梯度分片",
    "parameter sharding": "参数分片",
    "optimizer state / gradient / parameter sharding": "优化器状态 / 梯度 / 参数分片",
    "CPU offload": "CPU 卸载",
    # mixed precision (lesson 06)
    "mixed precision": "混合精度",
    "automatic mixed precision (autocast)": "自动混合精度",
    "master weights": "主权重",
    "half precision (fp16)": "半精度",
    "bfloat16": "脑浮点 16 位",
    "bfloat16 (bf16)": "脑浮点 16 位",
    "exponent": "指数位",
    "mantissa": "尾数位",
    "machine epsilon": "机器精度",
    "subnormal number": "次正规数（非规格化数）",
    "rounding": "舍入",
    "overflow": "上溢",
    "underflow": "下溢",
    "loss scaling": "损失缩放",
    "dynamic loss scaler": "动态损失缩放器",
    "skipped step": "跳过的步",
    "tensor core": "张量核心",
    # memory savers (lesson 07)
    "activations": "激活值",
    "activation checkpointing (recomputation)": "激活检查点（重计算）",
    "recomputation": "重计算",
    "selective checkpointing": "选择性检查点",
    "selective activation recomputation": "选择性激活重计算",
    "attention scores": "注意力分数",
    "FlashAttention": "FlashAttention",
    "fused kernel": "融合算子",
    "memory budget": "显存预算",
    # 3D parallelism (lesson 08)
    "3D parallelism": "3D 并行",
    "process grid": "进程网格",
    "device mesh": "设备网格",
    "model states": "模型状态",
    "node": "节点",
    "fake process group": "伪进程组",
    "parallelism layout": "并行布局",
    "strategy planner": "并行策略规划器",
    # training at scale in practice (lesson 09)
    "learning-rate schedule": "学习率调度",
    "cosine decay": "余弦衰减",
    "layer-wise learning rate": "分层学习率",
    "gradient clipping": "梯度裁剪",
    "global gradient norm": "全局梯度范数",
    "loss spike": "损失尖峰",
    "divergence": "训练发散",
    "monitoring": "监控",
    "alert rule": "告警规则",
    "straggler": "慢节点（掉队者）",
    "distributed checkpoint": "分布式检查点",
    "resume": "断点续训",
    "resharding": "重新分片",
    "asynchronous checkpoint": "异步检查点",
    "elastic restart": "弹性重启",
    "fault tolerance": "容错",
    "mean time between failures (MTBF)": "平均故障间隔时间（MTBF）",
    "GPU-hours": "GPU 小时",
    "z-score": "Z 分数（标准分数）",
    "rewind and skip (data batches)": "回滚并跳过（数据批次）",
    "attention logit": "注意力 logit（注意力分数）",
    "QK-norm": "QK 归一化",
    "z-loss": "z 损失（z-loss）",
    "hang": "挂起（卡死）",
    "watchdog": "看门狗",
    "flight recorder": "飞行记录器",
    "padding": "填充",
    "token-weighted loss": "按词元加权的损失",
    "stateful data loader": "有状态的数据加载器",
    # long sequences: context parallelism (lesson 10)
    "long sequence": "长序列",
    "context parallelism": "上下文并行",
    "ring attention": "环形注意力",
    "blockwise attention": "分块注意力",
    "online softmax": "在线 softmax",
    "log-sum-exp": "对数求和指数（log-sum-exp）",
    "load-balanced split": "负载均衡切分",
    "all-gather context parallelism": "全收集式上下文并行",
    "Ulysses all-to-all": "Ulysses 全对全通信",
    "all-to-all": "全对全",
    "grouped-query attention (GQA)": "分组查询注意力（GQA）",
    "document mask": "文档掩码",
    "packed sequence": "打包序列",
    "hybrid context parallelism": "混合上下文并行",
    # mixture of experts and expert parallelism (lesson 11)
    "mixture of experts (MoE)": "混合专家（MoE）",
    "expert": "专家",
    "expert parallelism": "专家并行",
    "expert-data parallelism": "专家数据并行",
    "router": "路由器",
    "top-k routing": "top-k 路由",
    "load balancing": "负载均衡",
    "load-balancing loss": "负载均衡损失",
    "auxiliary-loss-free balancing": "无辅助损失的负载均衡",
    "capacity factor": "容量因子",
    "dropped tokens": "丢弃的 token",
    "shared expert": "共享专家",
    "active parameters": "激活参数",
    "total parameters": "总参数",
    "node-limited routing": "节点受限路由",
    "grouped GEMM": "分组矩阵乘（grouped GEMM）",
    "dropless MoE": "无丢弃 MoE",
    "router z-loss": "路由 z 损失",
    "expert tensor parallelism": "专家张量并行",
    "fine-grained experts": "细粒度专家",
    # one device at full speed (lesson 12)
    "FP8 (8-bit floating point)": "8 位浮点（FP8）",
    "scaling factor": "缩放因子",
    "tensorwise scaling": "按张量缩放",
    "rowwise scaling": "按行缩放",
    "blockwise scaling": "按块缩放",
    "saturation": "饱和（截断到最大值）",
    "padded vocabulary": "填充后的词表",
    "fused optimizer": "融合优化器",
    "kernel launch overhead": "内核启动开销",
    "CUDA graph": "CUDA 图",
    "graph compilation (torch.compile)": "图编译（torch.compile）",
}

_ROW = re.compile(r"^\|\s*(?P<en>[^|]+?)\s*\|\s*(?P<zh>[^|]*?)\s*\|\s*$")


def chinese(term: str) -> str:
    """The Chinese of ``term``: the whole term, else each `` / ``-separated part; KeyError names what is missing."""
    if term in TERMS:
        return TERMS[term]
    parts = [p.strip() for p in term.split(" / ")]
    missing = [p for p in parts if p not in TERMS]
    if len(parts) == 1 or missing:
        raise KeyError(f"glossary term {', '.join(repr(p) for p in missing or parts)} is not in "
                       "course_lib/glossary.py TERMS: add it there (one Chinese term per concept)")
    return " / ".join(TERMS[p] for p in parts)


def glossary_rows(markdown: str) -> list[str]:
    """The English terms of the glossary table in one markdown cell (empty when the cell has no glossary)."""
    if HEADING not in markdown:
        return []
    rows = []
    for line in markdown[markdown.index(HEADING):].splitlines()[1:]:
        m = _ROW.match(line)
        if m and m["en"] != "English" and not set(m["en"]) <= set("-: "):
            rows.append(m["en"])
    return rows


def sync_cell(markdown: str) -> str:
    """``markdown`` with the Chinese column of its glossary table regenerated from :data:`TERMS`."""
    if HEADING not in markdown:
        return markdown
    head, tail = markdown[:markdown.index(HEADING)], markdown[markdown.index(HEADING):]
    lines = tail.split("\n")
    for i, line in enumerate(lines[1:], 1):
        m = _ROW.match(line)
        if m and m["en"] != "English" and not set(m["en"]) <= set("-: "):
            lines[i] = f"| {m['en']} | {chinese(m['en'])} |"
    return head + "\n".join(lines)


def sync_notebook(nb) -> bool:
    """Regenerate every glossary table of a notebook in place; True when something changed."""
    changed = False
    for cell in nb["cells"]:
        if cell.get("cell_type") == "markdown":
            src = nbio.source(cell)
            new = sync_cell(src)
            if new != src:
                cell["source"], changed = new, True
    return changed


def document(folders=("notebooks", "solutions"), root: str | Path = ".") -> str:
    """docs/GLOSSARY.md: every term with its Chinese and the lessons whose tables use it."""
    used: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((Path(root) / folder).glob("[0-9][0-9]_*.ipynb")):
            for cell in nbio.read(path).cells:
                for term in glossary_rows(nbio.source(cell)):
                    parts = [term] if term in TERMS else [p.strip() for p in term.split(" / ")]
                    for p in parts:
                        used.setdefault(p, set()).add(path.stem[:2])
    lines = ["# Glossary (English / 中文)", "",
             "Generated by `course build` from `course_lib/glossary.py`, the course's one glossary: every lesson's",
             "glossary table takes its Chinese from here. Edit the module, not this file.", "",
             "| English | 中文 | lessons |", "|---|---|---|"]
    for term in sorted(TERMS, key=str.lower):
        lessons = ", ".join(sorted(used.get(term, ()))) or "-"
        lines.append(f"| {term} | {TERMS[term]} | {lessons} |")
    return "\n".join(lines) + "\n"


def sync_course(root: str | Path, check: bool = False) -> list[str]:
    """Regenerate the glossary tables of ``root``'s notebooks/ and solutions/ and ``docs/GLOSSARY.md`` (with
    ``check=True`` only compare). Returns the stale / rewritten paths. ``course build`` runs it first, so the
    generated exercises carry the same tables."""
    root, changed = Path(root), []
    for folder in ("notebooks", "solutions"):
        for path in sorted((root / folder).glob("[0-9][0-9]_*.ipynb")):
            nb = nbio.read(path)
            try:
                stale = sync_notebook(nb)
            except KeyError as exc:
                raise KeyError(f"{path}: {exc.args[0]}") from None
            if stale:
                changed.append(str(path))
                if not check:
                    nbio.write(nb, path)
    doc, text = root / "docs" / "GLOSSARY.md", document(root=root)
    if not doc.exists() or doc.read_text(encoding="utf-8") != text:
        changed.append(str(doc))
        if not check:
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(text, encoding="utf-8")
    return changed
