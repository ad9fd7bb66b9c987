"""Pretrain a small GPT with megatron-core, with mindio high availability. Reads top to bottom.

    torchrun --nproc-per-node 4 examples/megatron/pretrain_gpt.py --use-distributed-optimizer \
        --train-iters 50 --enable-high-availability --save ckpt   # DP=4, each shard on 2 ranks
    torchrun --nproc-per-node 4 examples/megatron/pretrain_gpt.py --use-distributed-optimizer \
        --tensor-model-parallel-size 2 --save ckpt --save-interval 10
    torchrun --nproc-per-node 4 examples/megatron/pretrain_gpt.py --use-distributed-optimizer \
        --pipeline-model-parallel-size 2 --global-batch-size 8 --enable-high-availability --save ckpt  # PP2xDP2
    torchrun --nproc-per-node 4 examples/megatron/pretrain_gpt.py --use-distributed-optimizer \
        --num-experts 4 --expert-model-parallel-size 2 --enable-high-availability --save ckpt   # MoE, EP2

megatron-core 0.16.1 has no ``megatron.training``, so ``pretrain()``, ``train()``,
``train_step()`` and the arguments are written here with Megatron's names and flags. Lines marked
``# mindio:`` are the integration points (docs/megatron.md lists them). Defaults are tiny (2 layers,
hidden 64, sequence 64) and deterministic: fixed seeds, deterministic algorithms, data order
derived from the number of consumed samples; ``state-digest: <sha256>`` is printed after every
save and at the end so that runs compare bit for bit. Layout flags are Megatron-LM's (tensor, pipeline,
virtual pipeline, expert parallelism); checkpoints are Megatron's torch_dist format (docs/megatron.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mindio import _knobs
from mindio import drill  # mindio: fault injection for drills (--inject, docs/recovery.md)
from mindio import megatron as mio  # mindio: the Megatron adapter (imports megatron-core)
from mindio.adapter import local_digest
from mindio.megatron.elastic import register_elastic  # mindio: elastic training (zit handlers)
from mindio.megatron.verified import VerifiedState  # mindio: undo of silent corruption

try:  # mindio: the fault-tolerance API (tft_*); only needed with --enable-high-availability
    from mindio import ttp
except ImportError:  # pragma: no cover
    ttp = None

HERE = Path(__file__).resolve().parent
STANDBY = _knobs.get("MINDIO_STANDBY")  # mindio: a standby process for the elastic scale-out
log = logging.getLogger("pretrain_gpt")


# ---------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=64)
    a("--num-attention-heads", type=int, default=4)
    a("--seq-length", type=int, default=64)
    a("--max-position-embeddings", type=int, default=64)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
      help="interleaved pipeline schedule: layers per model chunk (needs >= 2 micro-batches per step)")
    a("--num-experts", type=int, default=None, help="mixture of experts: experts per MoE layer")
    a("--expert-model-parallel-size", type=int, default=1)
    a("--moe-router-topk", type=int, default=2)
    a("--micro-batch-size", type=int, default=2)
    a("--global-batch-size", type=int, default=None, help="default: micro batch x DP size")
    a("--train-iters", type=int, default=20)
    a("--exit-interval", type=int, default=None, help="exit when iteration %% interval == 0")
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=1e-4)
    a("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine"])
    a("--lr-warmup-iters", type=int, default=2)
    a("--weight-decay", type=float, default=0.01)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--seed", type=int, default=1234)
    a("--bf16", action="store_true")
    a("--use-distributed-optimizer", action="store_true")
    a("--save", default=None)
    a("--load", default=None)
    a("--save-interval", type=int, default=None)
    a("--no-initialization", dest="perform_initialization", action="store_false",
      help="do not initialise the weights (megatron's flag): only when a checkpoint is loaded; the example "
           "also skips it by itself when --load holds one")
    a("--acp-pool-gb", type=int, default=1,
      help="memory pool of the mindio checkpoint store started at launch when --save is given")
    a("--log-interval", type=int, default=1)
    a("--data-path", default=str(HERE / "data" / "corpus.txt"))
    a("--tokenizer-file", default=str(HERE / "data" / "tokenizer.json"))
    a("--inject", default=None, metavar="KIND:rank=R,step=S",
      help="fault injection for drills (mindio.drill): raise|uce|net|hang|kill|flip on rank R, or "
           "kill-node:node=N, while computing step S; once per job; ';' separates faults")
    a("--log-samples", default=None, metavar="DIR",
      help="data-order log: after every update, the sample indices the sampler gave this rank in that step, "
           "one JSON line per step in DIR/samples-rank<R>.jsonl (appended; tests compare runs with it)")
    a("--check-replicas", action="store_true",
      help="after every step, check that all replicas of every optimizer shard are bit-identical")
    mio.add_high_availability_args(p)  # mindio: --enable-high-availability & co.
    args = p.parse_args(argv)
    if args.inject:
        try:
            drill.parse(args.inject)  # a bad spec fails now, not at step S
        except ValueError as exc:
            p.error(str(exc))
    return mio.resolve_high_availability(args)  # mindio: HIGH_AVAILABILITY env var


# ---------------------------------------------------------------------------------------- data
class CorpusDataset:
    """The tokenized corpus cut into ``seq+1``-token samples; sample ``i`` of the infinite stream
    is drawn from a permutation seeded by (seed, epoch), so the order depends only on ``i``."""

    def __init__(self, path: str, tokenizer_file: str, seq_length: int, seed: int):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_file)
        self.vocab_size = tok.get_vocab_size()
        ids = tok.encode(Path(path).read_text(encoding="utf-8")).ids
        self.tokens = torch.tensor(ids, dtype=torch.long)
        self.seq, self.seed = seq_length, seed
        self.n = (len(ids) - 1) // seq_length
        if self.n < 1:
            raise ValueError(f"{path} is too short for --seq-length {seq_length}")
        self._perm_epoch, self._perm = -1, None

    def __getitem__(self, i: int) -> torch.Tensor:
        epoch, j = divmod(i, self.n)
        if epoch != self._perm_epoch:
            self._perm = np.random.RandomState(self.seed + epoch).permutation(self.n)
            self._perm_epoch = epoch
        k = int(self._perm[j]) * self.seq
        return self.tokens[k:k + self.seq + 1]


def batch_iterator(dataset, consumed_samples: int, args, taken: list | None = None):
    """Megatron's pretraining sampler: each step takes ``global_batch_size`` consecutive samples;
    each micro-batch of the step is ``mbs * dp`` of them, this DP rank takes its ``mbs`` slice.
    ``taken``: the sample indices yielded are appended to it (``--log-samples``)."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    i = consumed_samples
    while True:
        start = i + dp_rank * args.micro_batch_size
        if taken is not None:
            taken.extend(range(start, start + args.micro_batch_size))
        yield torch.stack([dataset[start + k] for k in range(args.micro_batch_size)])
        i += args.micro_batch_size * dp


class SampleLog:
    """``--log-samples DIR``: one line per committed update, ``{"iteration", "rank", "dp", "dp_rank",
    "samples", "t"}``, the samples being what the sampler yielded to this rank during that step (model
    chunk 0). A step that is retried, rolled back or recomputed logs again; the later line stands."""

    def __init__(self):
        self.taken: list = []
        self.path: Path | None = None

    def to(self, directory) -> None:
        self.path = None if directory is None else Path(directory)

    def iterators(self, dataset, consumed_samples: int, args, chunks: int):
        """One sampler per model chunk, from ``consumed_samples``; only chunk 0's samples are logged
        (the interleaved schedule reads the same micro-batch once per chunk)."""
        its = [batch_iterator(dataset, consumed_samples, args, self.taken if c == 0 else None)
               for c in range(chunks)]
        return its if chunks > 1 else its[0]

    def begin(self) -> None:
        self.taken.clear()

    def commit(self, iteration: int) -> None:
        if self.path is None:
            return
        from megatron.core import parallel_state as ps

        rank = dist.get_rank()
        line = json.dumps({"iteration": iteration, "rank": rank, "dp": ps.get_data_parallel_world_size(),
                           "dp_rank": ps.get_data_parallel_rank(), "samples": self.taken, "t": time.time()})
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / f"samples-rank{rank}.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        self.taken.clear()


# ------------------------------------------------------------------------- model and optimizer
def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def transformer_config(args):
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        pipeline_dtype=dtype, num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        moe_router_topk=args.moe_router_topk, moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True,  # TP=2 then initialises exactly like TP=1
        perform_initialization=args.perform_initialization,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=args.bf16, params_dtype=dtype)


def virtual_pipeline_size(args):
    """Model chunks per pipeline rank (interleaved schedule), or None."""
    per = args.num_layers_per_virtual_pipeline_stage
    if per is None:
        return None
    pp = args.pipeline_model_parallel_size
    if pp < 2 or args.num_layers % (pp * per):
        raise SystemExit(f"--num-layers-per-virtual-pipeline-stage {per}: needs pipeline parallelism and "
                         f"--num-layers ({args.num_layers}) divisible by PP x {per}")
    return args.num_layers // (pp * per)


def setup_model_and_optimizer(args):
    """Model chunks (DDP; several with the interleaved schedule), optimizer and LR scheduler on the
    current parallel state."""
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = transformer_config(args)
    chunks = []
    for vp_stage in range(config.virtual_pipeline_model_parallel_size or 1):
        vp = vp_stage if config.virtual_pipeline_model_parallel_size else None
        chunk = model_provider(args, config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                               ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp), vp)
        chunks.append(Float16Module(config, chunk) if args.bf16 else chunk)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=mio.replica_count(args))  # mindio: replicas
    model = [DDP(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    # Megatron-LM's training.py sets these; without them megatron-core never reduces gradients.
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    mio.install()  # mindio: get_megatron_optimizer builds the ReplicaDistributedOptimizer
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
        bf16=args.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, model)
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.train_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant")
    return model, optimizer, scheduler


# --------------------------------------------------------------------------------- train loop
def poison_shard(ctx) -> None:
    """``--inject uce:...``: the memory error destroyed this rank's optimizer shard (NaN); only a
    repair from a replica brings it back."""
    if ctx.optimizer is not None:
        with torch.no_grad():
            for t in ctx.shard_tensors():
                t.fill_(float("nan"))


def forward_step(ctx, data_iterator, model):
    """One micro-batch: tokens -> per-token losses; the loss function averages them."""
    if ctx.stop_requested.is_set():  # mindio: the stop callback parks training here
        raise RuntimeError("FORCE STOP")
    if ctx.args.inject:  # mindio: drills; each fault fires once per job
        drill.inject(ctx.args.inject, ctx.iteration + 1, dist.get_rank(),
                     corrupt=lambda: poison_shard(ctx),
                     flip=lambda state, bit: mio.distributed_optimizers(ctx.optimizer)[0].flip_bit(state, bit))
    batch = next(data_iterator)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    position_ids = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        # clone: megatron divides the returned loss in place by num_microbatches (a detached view
        # would report loss / num_microbatches as soon as there is gradient accumulation)
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, ctx):
    """Forward/backward over all micro-batches, then one optimizer update (bracketed for mindio)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = ctx.args
    SAMPLES.begin()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=lambda it, m: forward_step_func(ctx, it, m),
        data_iterator=data_iterator, model=model, num_microbatches=args.num_microbatches,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
    if args.enable_high_availability:
        ttp.tft_start_updating_os(-1)  # mindio: optimizer state is being updated
    update_successful, grad_norm, _ = optimizer.step()
    ctx.iteration += 1
    ctx.consumed_samples += args.global_batch_size
    if args.enable_high_availability:
        ttp.tft_end_updating_os(ctx.iteration)  # mindio: state is complete for this step
        ctx.record_step_rng()  # mindio: the RNG a rollback to this step restores on every stage
    SAMPLES.commit(ctx.iteration)
    opt_param_scheduler.step(increment=args.global_batch_size)
    loss = torch.zeros(1)
    if ps.is_pipeline_last_stage():
        loss = torch.stack([x["lm loss"] for x in losses]).mean().reshape(1)
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    if args.pipeline_model_parallel_size > 1:
        dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    return loss.item() / ps.get_data_parallel_world_size(), grad_norm, update_successful


def check_replicas(ctx) -> None:
    """Every shard's replicas (same shard index in its DP group: the dense DP group, or the expert-DP
    group for MoE experts) must be bit-identical."""
    from megatron.core import parallel_state as ps

    groups = [ps.get_data_parallel_group(with_context_parallel=True), ps.get_expert_data_parallel_group()]
    for t, tensors in enumerate(ctx.shard_groups()):
        digest = local_digest((str(i), x) for i, x in enumerate(tensors))
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).clone()
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(groups[t]))]
        dist.all_gather(parts, mine, group=groups[t])
        shards = len(parts) // ctx.replica_cnt
        for pos, part in enumerate(parts):
            if not torch.equal(part, parts[pos % shards]):
                raise RuntimeError(f"iteration {ctx.iteration}: shard {pos % shards} of optimizer {t} "
                                   f"differs between DP positions {pos % shards} and {pos}")


SAMPLES = SampleLog()  # --log-samples
VERIFIED = VerifiedState()  # mindio: the replica cross-check's undo (MINDIO_CROSSCHECK_STEPS; 0: a no-op)


def train(forward_step_func, ctx, dataset):
    """The loop. Re-entered after an in-process recovery: everything is read from ``ctx``."""
    args = ctx.args
    # one iterator per model chunk (the interleaved schedule reads each chunk's micro-batches in turn)
    data_iterator = SAMPLES.iterators(dataset, ctx.consumed_samples, args, len(ctx.model))
    while ctx.iteration < args.train_iters:
        t0 = time.perf_counter()
        loss, grad_norm, ok = train_step(forward_step_func, data_iterator, ctx.model,
                                         ctx.optimizer, ctx.scheduler, ctx)
        if VERIFIED.after_step(ctx):  # mindio: a replica mismatch rolled the job back to verified state
            data_iterator = SAMPLES.iterators(dataset, ctx.consumed_samples, args, len(ctx.model))
            continue
        step_ms = (time.perf_counter() - t0) * 1000
        if args.check_replicas and ctx.replica_cnt > 1:
            check_replicas(ctx)
            print_rank_0(f"replicas-identical: iteration {ctx.iteration}")
        if ctx.iteration % args.log_interval == 0:
            lr = ctx.optimizer.param_groups[0]["lr"]
            print_rank_0(f"iteration {ctx.iteration:6d}/{args.train_iters} | lm loss {loss!r} | "
                         f"grad norm {grad_norm!r} | lr {lr:.6e} | step {step_ms:.1f} ms")
        if args.save and args.save_interval and ctx.iteration % args.save_interval == 0:
            save(ctx)
        if args.enable_high_availability:
            ttp.tft_pause_train(ctx.iteration)  # mindio: graceful pause point
        if args.exit_interval and ctx.iteration % args.exit_interval == 0:
            break
    return ctx.iteration


def save(ctx) -> None:
    seconds = mio.checkpoint.save_checkpoint(ctx)
    print_rank_0(f"saved checkpoint iteration {ctx.iteration} to {ctx.args.save} "
                 f"in {seconds * 1000:.0f} ms")
    print_rank_0(f"state-digest: {mio.state_digest(ctx)}")


# --------------------------------------------------------------------------- high availability
def setup_high_availability(ctx) -> None:
    """mindio: start the controller (rank 0) and processors, report replicas, register callbacks."""
    from megatron.core import parallel_state as ps

    if ttp is None or not hasattr(ttp, "tft_init_processor"):
        raise SystemExit("--enable-high-availability needs mindio.ttp (tft_* API), which is not "
                         "available in this installation; run without high availability")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = ctx.args
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    # TTP_PORT when set; else next to the job's store port (a fixed default collides between jobs)
    port = (_knobs.get("TTP_PORT") if os.environ.get("TTP_PORT")
            else int(os.environ.get("MASTER_PORT", 29500)) + 1)
    if rank == 0:  # (under mindio-run --high-availability its agent hosts the controller: these start none)
        if not mio.wants_dump(args):  # mindio: --no-dump (without --save it is refused at start): no dump planned
            wanted = _knobs.get("HIGH_AVAILABILITY") or (("dump",) + ("recover",) * args.enable_worker_reboot
                                                         + ("elastic-training",) * args.enable_elastic_training)
            os.environ["HIGH_AVAILABILITY"] = ",".join(s for s in wanted if s != "dump") or "exit"
        ttp.tft_init_controller(rank, world, False, enable_arf=args.enable_worker_reboot,
                                enable_zit=args.enable_elastic_training)
        ttp.tft_start_controller(addr, port, enable_tls=False)
    # the controller enables what the processors register with: --enable-hbmfault-repair -> retry,
    # --enable-worker-reboot -> recover-in-place (needs mindio-run --high-availability; refused at start
    # otherwise), --enable-elastic-training -> elastic training
    ttp.tft_init_processor(rank, world, False, enable_tls=False,
                           enable_uce=args.enable_hbmfault_repair,
                           enable_arf=args.enable_worker_reboot,
                           enable_zit=args.enable_elastic_training)
    ttp.tft_start_processor(addr, port)
    ttp.tft_set_optimizer_replica(rank, mio.replica.replica_info(ctx.replica_cnt, experts=ctx.has_experts))
    ttp.tft_set_dp_group_info(rank, mio.replica.dp_rank_list())
    adapter = mio.MegatronAdapter(ctx)
    mio.register(adapter, step_args=ctx)
    if args.enable_elastic_training:
        register_elastic(adapter)  # mindio: downgrade / upgrade handlers (zit)
    params = sum(p.numel() for c in ctx.model for p in c.parameters())
    d = ps.get_data_parallel_world_size(with_context_parallel=True)
    extra = mio.replica.memory_overhead_bytes(params, ctx.replica_cnt, d)
    print_rank_0(f"high availability on: replica_cnt={ctx.replica_cnt}, {params} params per "
                 f"model-parallel rank, replica memory overhead {extra / 2**20:.3f} MiB per rank "
                 f"(12*P*(R-1)/d)")


# ------------------------------------------------------------------------------------ pretrain
def report_memory(ctx) -> None:
    """Optimizer-state bytes on rank 0 (fp32 main params + 2 Adam moments) vs 12*P*R/d, summed over the
    distributed optimizers (dense params over the DP group; MoE expert params over the expert-DP group)."""
    if not ctx.args.use_distributed_optimizer:
        return
    state = sum(t.numel() * t.element_size() for i, t in enumerate(ctx.shard_tensors()) if i % 4 != 3)
    groups = ctx.layout["groups"]
    params = [0] * len(groups)
    for c in ctx.model:
        for p in c.parameters():
            params[1 if len(groups) > 1 and mio.digest.is_expert_param(p) else 0] += p.numel()
    formula = sum(12 * n * ctx.replica_cnt / d for n, (_, d) in zip(params, groups))
    print_rank_0(f"optimizer-state-bytes: {state} on rank 0 (P={sum(params)}, R={ctx.replica_cnt}, "
                 f"d={groups[0][1]}, 12*P*R/d={formula:.0f})")


def prepare(args) -> None:
    """What needs no process group; done before the world so that a hot-switch backup does it while the
    job still trains (mindio: its init_process_group waits for the switch, docs/recovery.md)."""
    mio.setup_cpu()  # mindio: megatron-core CPU patches (only when there is no CUDA)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    import megatron.core.distributed  # noqa: F401  (the model code of setup_model_and_optimizer, loaded now)
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401


def initialize(args) -> None:
    if not STANDBY:  # mindio: a standby joins the world only when the controller scales out
        dist.init_process_group("gloo")
    prepare(args)  # (once more is free: pretrain() did it before the world)
    world = int(os.environ["WORLD_SIZE"]) if STANDBY else dist.get_world_size()
    dp = world // (args.tensor_model_parallel_size
                                   * args.pipeline_model_parallel_size)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"micro batch x DP = {args.micro_batch_size * dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)


def pretrain(args) -> str:
    prepare(args)
    SAMPLES.to(args.log_samples)
    dataset = CorpusDataset(args.data_path, args.tokenizer_file, args.seq_length, args.seed)
    args.padded_vocab_size = dataset.vocab_size
    initialize(args)
    ctx = mio.TrainingContext(args, build=lambda: setup_model_and_optimizer(args))
    if STANDBY:
        return pretrain_standby(args, ctx, dataset)
    ctx.init_parallel()  # mindio: DP replica groups (num_distributed_optimizer_instances)
    found = bool(args.load) and mio.checkpoint.read_tracker(Path(args.load)) is not None
    replacement = args.enable_high_availability and ttp.tft_is_reboot_node()  # mindio: state from the replicas
    initialise = args.perform_initialization
    if not initialise and not found:
        raise SystemExit(f"--no-initialization needs a checkpoint to load (--load {args.load}: none there); "
                         "without one the weights would be uninitialised memory")
    # the checkpoint overwrites every weight (load_state_dict, strict): initialising them first is wasted
    # (1.7 s of a relaunch's build at 1 GiB per rank). mindio skips it by itself where the replicas
    # overwrite them (a replacement process, the builds of a recovery: mindio/megatron/restore_build.py)
    args.perform_initialization = initialise and not found
    ctx.model, ctx.optimizer, ctx.scheduler = ctx.build()
    args.perform_initialization = initialise
    if args.save:  # mindio: start the checkpoint store now, not on the first (or a dump) save
        mio.checkpoint.initialize_store({"memfs.data_block_pool_capacity_in_gb": args.acp_pool_gb})
    if args.load and not found:
        print_rank_0(f"no checkpoint in {args.load}: training from scratch")  # as Megatron does
    elif args.load and replacement:
        print(f"rank {dist.get_rank()}: replacement process: state comes from the replicas, not {args.load}",
              flush=True)  # mindio: recover-in-place / recover
    elif found:
        it = mio.checkpoint.load_checkpoint(ctx, fallback=True)  # mindio: a corrupt one -> the previous
        print_rank_0(f"loaded checkpoint iteration {it}: state-digest: {mio.state_digest(ctx)}")
    report_memory(ctx)
    train_fn = train
    if args.enable_high_availability:
        setup_high_availability(ctx)
        train_fn = ttp.tft_exception_handler(train)  # mindio: recovery re-enters train()
    train_fn(forward_step, ctx, dataset)
    return finish(ctx)


def pretrain_standby(args, ctx, dataset) -> str:
    """mindio: a standby process (MINDIO_STANDBY=1, RANK = a rank a downgrade removed; set by a test, or by a
    ``mindio-run --standby`` agent that took a vacant node, mindio/launch/elastic.py): register with the
    controller, wait until the scale-out rebuilt the world and repaired this rank from a replica, train."""
    from mindio.ttp import elastic

    if not args.enable_elastic_training:
        raise SystemExit("MINDIO_STANDBY=1 needs --enable-elastic-training (HIGH_AVAILABILITY=elastic-training)")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = (_knobs.get("TTP_PORT") if os.environ.get("TTP_PORT")
            else int(os.environ.get("MASTER_PORT", 29500)) + 1)

    def register():
        if args.save:
            mio.checkpoint.initialize_store({"memfs.data_block_pool_capacity_in_gb": args.acp_pool_gb})
        adapter = mio.MegatronAdapter(ctx)
        mio.register(adapter, step_args=ctx)
        register_elastic(adapter)

    ctl_addr = os.environ.get("TTP_ADDR") or addr  # mindio-run: the controller its node 0 agent hosts
    elastic.start_standby(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), ctl_addr, port, addr,
                          int(os.environ["MASTER_PORT"]), register=register)
    elastic.wait_for_scale_out()  # parked until the upgrade; a job ending first: exit with its code (75/76)
    ttp.tft_exception_handler(train)(forward_step, ctx, dataset)
    return finish(ctx)


def finish(ctx) -> str:
    args = ctx.args
    if args.save and not (args.save_interval and ctx.iteration % args.save_interval == 0):
        save(ctx)
    digest = mio.state_digest(ctx)
    print_rank_0(f"state-digest: {digest}")
    print_rank_0(f"max-rss-MiB: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}")
    if args.enable_high_availability:
        ttp.tft_destroy_processor()
        if dist.get_rank() == 0:
            ttp.tft_destroy_controller()
    dist.destroy_process_group()
    return digest


def print_rank_0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


if __name__ == "__main__":  # megatron's async checkpoint writer spawns: keep the guard
    _args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pretrain(_args)
