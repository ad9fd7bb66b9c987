"""mindio with plain PyTorch DDP (no Megatron): the same adapter interface, another framework.

    torchrun --nproc-per-node 2 examples/pytorch/train_ddp.py --train-iters 30
    torchrun --nproc-per-node 2 examples/pytorch/train_ddp.py --drill-step 10   # in-process repair
    torchrun --nproc-per-node 2 examples/pytorch/train_ddp.py --enable-high-availability
    torchrun --nproc-per-node 2 examples/pytorch/train_ddp.py --enable-high-availability \
        --inject raise:rank=1,step=10                                             # a drill

A small causal transformer (torch.nn only) learns the example corpus (examples/megatron/data) with
DDP and Adam. With plain DDP every rank holds the whole optimizer state, so every rank is a
replica of every other one (replica_cnt = world size). ``TorchDDPAdapter`` implements
:class:`mindio.adapter.FrameworkAdapter`; ``--drill-step N`` wipes rank 1's model and optimizer
state at step N and runs the callbacks in the order mindio.ttp runs them (stop, clean, new world,
rebuild groups, repair from rank 0, rollback), then training goes on. The ``state-digest`` printed
at the end equals that of a run without the drill, bit for bit. Lines marked ``# mindio:`` are the
integration points (docs/adapter.md).
"""

from __future__ import annotations

import argparse
import os
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch._dynamo  # noqa: F401  before init_process_group: see the note in main()
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mindio import _knobs
from mindio.adapter import (FrameworkAdapter, RepairRole, global_digest, local_digest,
                            recv_state, repair_pairs, send_state)
from mindio.adapter.transfer import capture_rng, restore_rng
from mindio.drill import inject as inject_fault, parse as parse_faults  # mindio: --inject drills

DATA = Path(__file__).resolve().parents[1] / "megatron" / "data"


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.size(1)))
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


class Trainer:
    """Everything the loop and the callbacks share (the plain-PyTorch TrainingContext)."""

    def __init__(self, args, tokens: torch.Tensor):
        self.args, self.tokens = args, tokens
        self.n = (len(tokens) - 1) // args.seq
        self.model = self.optimizer = None
        self.iteration = 0
        self.stop_requested = threading.Event()
        self.kept = None

    def build(self) -> None:
        torch.manual_seed(self.args.seed)
        module = TinyLM(self.args.vocab, self.args.dim, self.args.seq, self.args.layers)
        # same seed on every rank: no broadcast needed. find_unused_parameters: DDP keeps its initial bucket
        # layout instead of rebuilding it after the first step, so a model rebuilt by a recovery reduces
        # gradients in the same order as the uninterrupted run (bitwise equal with more than 2 ranks)
        self.model = DDP(module, init_sync=False, find_unused_parameters=True)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.args.lr)

    def sample(self, i: int) -> torch.Tensor:
        epoch, j = divmod(i, self.n)
        k = int(np.random.RandomState(self.args.seed + epoch).permutation(self.n)[j])
        return self.tokens[k * self.args.seq:(k + 1) * self.args.seq + 1]

    def state_tensors(self):
        """Params, then Adam's exp_avg, exp_avg_sq and step per param: the repairable state."""
        out = [p.data for p in self.model.parameters()]
        for p in self.model.parameters():
            st = self.optimizer.state[p]
            if not st:  # before the first step: allocate what Adam would
                st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                          exp_avg_sq=torch.zeros_like(p))
            out += [st["exp_avg"], st["exp_avg_sq"], st["step"].reshape(1)]
        return out

    def scalars(self):
        return {"iteration": self.iteration, "rng": capture_rng()}

    def train_step(self) -> float:
        a, rank, world = self.args, dist.get_rank(), dist.get_world_size()
        start = self.iteration * a.batch * world + rank * a.batch
        batch = torch.stack([self.sample(start + k) for k in range(a.batch)])
        if self.stop_requested.is_set():  # mindio: stop callback
            raise RuntimeError("FORCE STOP")
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, a.vocab), batch[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if a.enable_high_availability:
            ttp.tft_start_updating_os(-1)  # mindio
        self.optimizer.step()
        self.iteration += 1
        if a.enable_high_availability:
            ttp.tft_end_updating_os(self.iteration)  # mindio
        out = loss.detach().reshape(1)
        dist.all_reduce(out)
        return out.item() / world

    def digest(self) -> str:
        named = [(str(i), t) for i, t in enumerate(self.state_tensors())] if dist.get_rank() == 0 else []
        return global_digest(local_digest(named))


class TorchDDPAdapter(FrameworkAdapter):
    """mindio's recovery callbacks for plain DDP + a torch optimizer."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.rank = dist.get_rank()  # save() may run after a teardown destroyed the groups (a dump)

    def stop(self):
        self.t.stop_requested.set()

    def clean(self, is_uce_error):
        t = self.t
        try:  # keep local state; a corrupted rank gets it back by repair
            t.kept = ([x.detach().clone() for x in t.state_tensors()], t.scalars())
        except Exception:
            t.kept = None
        t.model = t.optimizer = None  # DDP holds the process group: drop it
        # and destroy it (DDP reduces over the default group): while it lives, its connections stay
        # open and a peer waiting in DDP's backward all-reduce for this rank is not released
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0  # no gc here: mindio's teardown collects once after every callback

    def rebuild_groups(self, fault_ranks):
        t = self.t
        t.build()
        if t.kept is not None:
            with torch.no_grad():
                for dst, src in zip(t.state_tensors(), t.kept[0]):
                    dst.copy_(src)
            t.iteration = t.kept[1]["iteration"]
        t.kept = None
        t.stop_requested.clear()

    def repair(self, step, need_rebuild, error_ranks, repair_info):
        me = dist.get_rank()
        for pair in repair_pairs(repair_info):
            if pair["role"] == RepairRole.SEND and me in pair["src"]:
                for src, dst in zip(pair["src"], pair["dst"]):
                    if src == me:
                        send_state(self.t.state_tensors(), self.t.scalars(), dst)
            elif pair["role"] in RepairRole.RECEIVERS and me in pair["dst"]:
                src = pair["src"][pair["dst"].index(me)]
                scalars = recv_state(self.t.state_tensors(), src)
                self.t.iteration = scalars["iteration"]
                restore_rng(scalars["rng"])

    def rollback(self, step):
        self.t.iteration = step  # data order derives from the iteration; params are the master
        self.t.optimizer.zero_grad(set_to_none=False)
        self.t.stop_requested.clear()

    def save(self, step, save_info):
        ranks = sorted({r for i in save_info for r in i.get("ranks", [])})
        if self.rank == ranks[0]:
            # after clean() (this rank's own error tore it down) the state is what clean() kept
            tensors = self.t.kept[0] if self.t.model is None else [x.clone() for x in self.t.state_tensors()]
            torch.save({"tensors": tensors, "iteration": step}, Path(self.t.args.save) / f"dump_{step}.pt")

    def rename(self, step):
        (Path(self.t.args.save) / "latest.txt").write_text(str(step))


def drill(adapter: TorchDDPAdapter, trainer: Trainer) -> None:
    """What mindio.ttp does for a step retry after rank 1 lost its memory, done in-process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = trainer.iteration
    if rank == 1:
        with torch.no_grad():
            for x in trainer.state_tensors():
                x.fill_(float("nan"))
        trainer.iteration = -1
    adapter.stop()
    adapter.clean(is_uce_error=rank == 1)  # destroys the default group too
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("mindio/gen1", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    adapter.rebuild_groups([1])
    info = {"type": 0, "src": [0], "dst": [1], "rank_list": [0, 1]}
    role = {0: "RT_SEND", 1: "RT_UCE_LOWLEVEL"}.get(rank)
    if role:
        adapter.repair(step, False, [1], {**info, "repair_type": role})
    adapter.rollback(step)
    if rank == 0:
        print(f"drill: rank 1 repaired from rank 0 at step {step}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", default=".")
    p.add_argument("--drill-step", type=int, default=None)
    p.add_argument("--inject", default=None, metavar="KIND:rank=R,step=S",
                   help="fault injection (mindio.drill, docs/recovery.md), once per job")
    p.add_argument("--enable-high-availability", action="store_true")
    args = p.parse_args()
    if args.inject:
        try:
            parse_faults(args.inject)  # a bad spec fails now, not at step S
        except ValueError as exc:
            p.error(str(exc))

    # torch._dynamo is imported above, before the default group exists: DDP's and Adam's constructors import
    # it, and imported after init_process_group it keeps that group alive past
    # destroy_process_group (torch 2.13, measured: its 2 gloo worker threads still run at exit), which leaves
    # the interpreter's shutdown open to pytorch/pytorch#190489 (SIGABRT, "terminate called without an
    # active exception")
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA / "tokenizer.json"))
    args.vocab = tok.get_vocab_size()
    tokens = torch.tensor(tok.encode((DATA / "corpus.txt").read_text()).ids, dtype=torch.long)
    trainer = Trainer(args, tokens)
    trainer.build()
    adapter = TorchDDPAdapter(trainer)
    rank, world = dist.get_rank(), dist.get_world_size()

    def train():
        while trainer.iteration < args.train_iters:
            inject_fault(args.inject, trainer.iteration + 1, rank)  # mindio: --inject drills
            loss = trainer.train_step()
            if rank == 0:
                print(f"iteration {trainer.iteration:4d} | loss {loss!r}", flush=True)
            if args.drill_step and trainer.iteration == args.drill_step and not drilled:
                drilled.append(True)
                drill(adapter, trainer)

    drilled = []
    if args.enable_high_availability:  # mindio: controller on rank 0, processors, callbacks
        port = (_knobs.get("TTP_PORT") if os.environ.get("TTP_PORT")
                else int(os.environ.get("MASTER_PORT", 29500)) + 1)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if rank == 0:  # (none when mindio-run --high-availability hosts it)
            ttp.tft_init_controller(rank, world, False)
            ttp.tft_start_controller(addr, port, enable_tls=False)
        ttp.tft_init_processor(rank, world, False, enable_tls=False)
        ttp.tft_start_processor(addr, port)
        # plain DDP: every rank holds the whole optimizer state (replica_cnt = world size)
        ttp.tft_set_optimizer_replica(rank, [{"rank_list": list(range(world)),
                                              "replica_cnt": world, "replica_shift": 0}])
        ttp.tft_set_dp_group_info(rank, list(range(world)))
        from mindio.adapter import register

        register(adapter, step_args=trainer)
        train = ttp.tft_exception_handler(train)
    train()
    digest = trainer.digest()
    if rank == 0:
        print(f"state-digest: {digest}", flush=True)
    if args.enable_high_availability:
        ttp.tft_destroy_processor()
        if rank == 0:
            ttp.tft_destroy_controller()
    trainer.model = trainer.optimizer = None  # DDP holds the group: release it before destroying
    dist.barrier()
    dist.destroy_process_group()


try:
    from mindio import ttp  # mindio: only used with --enable-high-availability
except ImportError:  # pragma: no cover
    ttp = None

if __name__ == "__main__":
    main()
