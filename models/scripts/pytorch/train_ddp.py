"""A small transformer language model trained with DistributedDataParallel over gloo, on the CPU.

Checks that the world is whole (every rank joined, the all-reduce of ones is the world size) and that after
training every rank holds the same weights (DDP's promise); only the last rank prints the throughput, as
Megatron and Primus do. Short timeouts: a dead rank fails the run in seconds (the pipeline's fail-fast then stops
the others), not after torch's default 30 minutes.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 2
RANK0_GRACE_SECONDS = 2.0  # leave_rank0_last: 20 times the torchrun agents' poll of their workers


class TinyLM(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(seq_len, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=4 * WIDTH, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, LAYERS)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.position))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = int(os.environ["WORLD_SIZE"])
    ones = torch.ones(1)
    dist.all_reduce(ones)
    if world != expected or int(ones.item()) != world:
        raise RuntimeError(
            f"the world is not whole: {world} ranks joined, {int(ones.item())} answered, {expected} expected"
        )
    print(f"rank {rank}/{world} joined on {os.uname().nodename} (gloo, {torch.__version__})", flush=True)

    torch.manual_seed(0)  # the same initial weights everywhere; DDP broadcasts rank 0's anyway
    model = DistributedDataParallel(TinyLM(args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    tokens_per_step = args.batch * args.seq_len * world
    start = None
    for step in range(args.steps):
        if step == 1:
            dist.barrier()
            start = time.perf_counter()  # the first step warms up
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=generator)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    elapsed = time.perf_counter() - start

    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, checksum)
    if any(abs(other.item() - checksum.item()) > 1e-9 * max(1.0, abs(checksum.item())) for other in everyone):
        raise RuntimeError(f"the ranks' weights disagree after training: {[other.item() for other in everyone]}")
    print(f"rank {rank}: weights agree across {world} ranks (checksum {checksum.item():.6f})", flush=True)
    if rank == world - 1:
        print(f"performance: {tokens_per_step * (args.steps - 1) / elapsed:.1f} tokens/sec", flush=True)
    leave_rank0_last(rank)


def leave_rank0_last(rank):
    """End every rank at once, rank 0 last, and without torch's teardown.

    Rank 0's node's torchrun agent hosts the store every agent meets in at exit (the exit barrier); when it arrived
    there before another agent had finished, it shut the store down under that agent, which then failed with
    'Connection was likely closed' (2 runs in 12 on the lab, under load). The other agents see their worker gone
    within their 0.1 s poll and wait in the barrier; rank 0 comes in after them. And gloo's teardown
    (destroy_process_group, then the interpreter's exit) aborted a rank once in 30 runs ('terminate called without
    an active exception', SIGABRT) after its work was done and checked: the ranks leave with os._exit, their
    output flushed, and the kernel closes their sockets."""
    dist.barrier()
    if rank == 0:
        time.sleep(RANK0_GRACE_SECONDS)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
