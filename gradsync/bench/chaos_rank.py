"""The training job of ``gradsync bench chaos``: one elastic worker that logs what it did.

``gradsync bench chaos`` starts this module as every worker of a ``gradsync run`` elastic job
and breaks the job while it trains; everything the bench reports is read from the lines
written here, with the workers' own clocks (one machine: one clock), so a faster detection
or recovery in the library shows up in the report without a change here.

The job is deterministic: the data set (``--samples`` rows of a fixed linear problem) and the
model's first parameters come from fixed seeds, and the sample order is
``hvd.elastic.ElasticSampler``'s (one permutation per epoch, consumed from the front whatever
the job's size does). Each worker takes ``--batch`` samples a step. Lines, one per event
(``wall`` is ``time.time()``):

Every line names its worker by its pid ``P`` (the bench signals it by that pid too):

- ``CHAOS hello p=P host=H wall=T``: the worker started on emulated host H;
- ``CHAOS step p=P g=G r=R n=N s=S e=E wall=T h=HASH i=I,I,...``: step S (of the job's step
  count, which a roll-back rewinds) of epoch E completed by rank R of N in generation G; HASH
  is a digest of every parameter after the update (identical on every rank, or the ranks
  diverged); I are the data set's rows this rank consumed in the step;
- ``CHAOS raised p=P g=G wall=T what=NAME``: the step loop saw NAME (a lost peer, a timeout, new
  hosts) and hands it to ``hvd.elastic.run``, which re-forms the job;
- ``CHAOS reset p=P g=G wall=T``: the job was re-formed; this worker is in generation G now.

The job ends when rank 0, at a commit, finds ``--stop-file`` exists (the bench makes it);
every rank learns it from the same broadcast, so all stop after the same step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

__all__ = ["parser", "main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m gradsync.bench.chaos_rank",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stop-file", required=True,
                   help="the job stops at the first commit after this file exists")
    p.add_argument("--params", type=int, default=100_000, help="model size (parameters)")
    p.add_argument("--samples", type=int, default=2048, help="rows of the data set")
    p.add_argument("--batch", type=int, default=16, help="samples per worker and step")
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    p.add_argument("--compute", type=float, default=0.02,
                   help="seconds of emulated compute per step (a sleep: an accelerator's time "
                        "that leaves the cores to the communication)")
    return p


def _digest(model) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv=None) -> None:
    options = parser().parse_args(argv)
    import torch

    import gradsync.torch as hvd
    from gradsync.elastic.worker import generation

    pid = os.getpid()  # names the worker in every line: first ranks are reused by joiners
    print(f"CHAOS hello p={pid} host={os.environ.get('GRADSYNC_HOSTNAME', '?')} "
          f"wall={time.time():.6f}", flush=True)
    hvd.init()
    torch.set_num_threads(1)
    # The same data and first parameters on every worker, joiners included: the first
    # sync() overwrites a joiner's parameters anyway, but a fixed seed keeps runs comparable.
    torch.manual_seed(0)
    width = max(8, int((options.params / 2) ** 0.5))
    features = torch.randn(options.samples, width)
    targets = features @ torch.randn(width, 1)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(options.samples), shuffle=True, seed=0,
                                         batch_size=options.batch)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, step=0, epoch=0,
                                   done=False)
    state.register_reset_callbacks([lambda: print(
        f"CHAOS reset p={pid} g={generation()} wall={time.time():.6f}", flush=True)])

    def stop_agreed() -> bool:
        # Rank 0 decides, and a broadcast makes every rank stop after the same step.
        flag = torch.tensor([float(os.path.exists(options.stop_file))])
        return bool(hvd.broadcast(flag, root_rank=0, name="chaos.stop").item())

    def one_pass(state) -> None:
        mine = list(state.sampler)
        for batch, start in enumerate(range(0, len(mine), options.batch)):
            rows = mine[start:start + options.batch]
            # What this rank is about to use, before the exchange: a rank lost after the
            # exchange but before its step line still shows which samples went into the step.
            print(f"CHAOS take p={pid} g={generation()} r={hvd.rank()} n={hvd.size()} "
                  f"s={state.step + 1} e={state.epoch} i={','.join(map(str, rows))}", flush=True)
            optimizer.zero_grad()
            loss = (model(features[rows]) - targets[rows]).square().mean()
            loss.backward()
            time.sleep(options.compute)
            optimizer.step()
            state.sampler.record_batch(batch)
            state.step += 1
            print(f"CHAOS step p={pid} g={generation()} r={hvd.rank()} n={hvd.size()} "
                  f"s={state.step} e={state.epoch} wall={time.time():.6f} h={_digest(model)} "
                  f"i={','.join(map(str, rows))}", flush=True)
            if state.step % options.commit_every == 0:
                # The commit first: a failure in the stop broadcast then rolls back to a commit
                # of this very step (nothing lost); before it, to the previous commit.
                state.commit()
                state.done = stop_agreed()
                if state.done:
                    return
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()

    @hvd.elastic.run
    def train(state):
        while not state.done:
            try:
                one_pass(state)
            except BaseException as exc:
                # The detection time is when the step loop learns of the fault: logged here,
                # then the elastic loop does what it always does with the exception.
                print(f"CHAOS raised p={pid} g={generation()} wall={time.time():.6f} "
                      f"what={type(exc).__name__}", flush=True)
                raise

    train(state)
    print(f"CHAOS done p={pid} g={generation()} r={hvd.rank()} s={state.step} "
          f"wall={time.time():.6f}", flush=True)


if __name__ == "__main__":
    main()
