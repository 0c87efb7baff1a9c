"""Elastic jobs end to end: a worker lost in every way, hosts added, limits reached.

Each job runs tests/ranks/elastic_train.py under ``gradsync run --min-np ...``; every worker
that finishes prints ``RESULT id=... rank=... size=... gen=... steps=... hash=...``. The
closed-form checks: the surviving workers are exactly the expected ones, ranks are 0..size-1,
every worker ends in the same generation with the same parameter digest, and the launcher's
messages name the failure. The jobs take 30-60 s each on a loaded 2-core machine: all but one
are in the slow tier.
"""

import os
import re
import sys
import types

import pytest

from harness import launch, remote_ssh, run_job, worker_results

from gradsync.testbed.procfs import gone

pytestmark = pytest.mark.multiprocess

FAST_HEARTBEAT = {"GRADSYNC_HEARTBEAT_TIMEOUT": "3", "GRADSYNC_HEARTBEAT_INTERVAL": "0.5"}


def check_consistent(result, workers: list[str], size: int) -> dict[str, dict]:
    assert result.returncode == 0, result
    got = worker_results(result.output)
    assert sorted(got) == sorted(workers), result
    assert sorted(int(r["rank"]) for r in got.values()) == list(range(size)), result
    assert {r["size"] for r in got.values()} == {str(size)}, result
    assert len({r["gen"] for r in got.values()}) == 1, result
    assert len({r["hash"] for r in got.values()}) == 1, result  # identical parameters
    assert len({r["steps"] for r in got.values()}) == 1, result
    return got


def starts(output: str, gen: str) -> dict[str, dict]:
    """The START lines of generation ``gen``, by worker."""
    found = {}
    for line in re.findall(r"START (.*)", output):
        fields = dict(item.split("=", 1) for item in line.split())
        worker = fields.pop("id")
        if fields["gen"] == gen:
            found[worker] = {k: int(v) for k, v in fields.items()}
    return found


def check_rolled_back(output: str, new_rank_0: str, at: int, per_epoch: int) -> None:
    """Generation 1 starts from the new rank 0's last commit, never earlier: a commit every 2
    steps, so at least the last even step count before the victim's step ``at``. (The
    survivors may have finished the victim's step if its gradients got out before it died.)"""
    got = starts(output, "1")
    assert len({(s["steps"], s["epoch"]) for s in got.values()}) == 1, output
    restored = got[new_rank_0]
    assert restored["rank"] == 0 and restored["steps"] == restored["committed"], output
    assert restored["steps"] >= at - at % 2, output
    # the epoch goes with the steps; a commit at an epoch's last batch comes before the epoch
    # counter moves on, so it holds the epoch just finished
    epoch, steps = restored["epoch"], restored["steps"]
    assert epoch == steps // per_epoch or (steps % per_epoch == 0 and
                                           epoch == steps // per_epoch - 1), output


def check_went_on(output: str, at: int) -> None:
    """Generation 1 starts where the survivors were (recovery.py), whatever their last
    commit: the victim died in the step after ``at`` updates, so every worker starts
    generation 1 at ``at`` steps, going on from its live state; or, when the victim's
    gradients got out before it died and the survivors finished its step, at ``at + 1``, by
    going on, or by a roll-back that loses nothing when they met the loss in the commit()
    that follows every second step."""
    got = starts(output, "1")
    assert len({(s["steps"], s["epoch"]) for s in got.values()}) == 1, output
    [steps] = {s["steps"] for s in got.values()}
    allowed = {f"action=go_on updates={steps} lost=0"}
    if steps == at + 1 and steps % 2 == 0:
        allowed.add(f"action=rollback updates={steps} lost=0")
    assert steps in (at, at + 1), output
    assert len(set(re.findall(r"PLAN (.*)", output))) == 1, output
    assert set(re.findall(r"PLAN (.*)", output)) <= allowed, output


def job(np_, *args, launcher=(), env=None, timeout=240):
    return launch(np_, "elastic_train.py", *map(str, args), timeout=timeout, env=env,
                  launcher_args=("--min-np", "2", *launcher))


def test_sigkill_one_of_four_mid_step_goes_on_at_three_with_identical_parameters():
    result = job(4, "kill", 2, 5, env={"GRADSYNC_LOG_LEVEL": "INFO"})
    got = check_consistent(result, ["localhost[0]", "localhost[1]", "localhost[3]"], 3)
    assert "worker localhost[2] (rank 2 of generation 0) was killed by signal 9" in \
        result.output, result
    # At INFO the launcher and the new rank 0 say who left (and the launcher which process
    # each worker of the new generation is).
    assert "gradsync run: generation 1: joined none; left localhost[2]" in result.output, result
    assert "INFO gradsync: generation 1 after 0: joined none; left localhost[2]" in \
        result.output, result
    assert re.search(r"^gradsync run: generation 1: rank 2 \(worker localhost\[3\]\) on host "
                     r"localhost: pid \d+$", result.output, re.M), result
    assert {r["gen"] for r in got.values()} == {"1"}
    # the ranks keep their order: 0, 1, 3 become 0, 1, 2
    assert [got[w]["rank"] for w in ("localhost[0]", "localhost[1]", "localhost[3]")] == \
        ["0", "1", "2"]
    check_went_on(result.output, 5)
    if os.environ.get("GS_TEST_START_METHOD", "forkserver") == "forkserver":
        # forked from a template that imported what the first optimizer imports
        # (forkserver.ELASTIC_PRELOAD): 1.6 s of CPU a worker less
        assert result.output.count("PRELOADED dynamo=True") == 4, result


def test_members_that_read_two_generations_form_the_newer_one():
    """Found in CI (test_elastic_compress, PowerSGD): a new worker was ready as the survivors
    of a kill re-formed, and they read the newest generation on either side of the next one's
    publication. One waited in generation 1 for the other, which waited in 2 for it, until the
    rank's deadline (3 min 52 s). A generation that a newer one replaces before it formed is
    now aborted (``Generations.publish``). By hand here, the launcher's part played by the
    test: ``a`` waits in generation 0 for ``b``; generation 1 (``b, a, c``) comes; ``b`` and
    ``c`` read it. All three must form generation 1 within seconds, not after ``a``'s connect
    timeout (the elastic timeout: 60 s)."""
    import signal
    import subprocess
    import time

    from harness import RANKS, report, start as start_process

    from gradsync.run.generations import Generations
    from gradsync.run.ranks import start_store

    store = start_store("127.0.0.1")
    said: list[str] = []
    gens = Generations(said.append)
    gens.host(store, "split", store.port)
    a, b, c = (types.SimpleNamespace(id=w, host="localhost") for w in "abc")
    procs: dict = {}  # worker -> gradsync.run.processes.Process

    def start(worker: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
        env.update({"GRADSYNC_RANK": "0", "GRADSYNC_SIZE": "1", "GRADSYNC_JOB_ID": "split",
                    "GRADSYNC_STORE_ADDR": "127.0.0.1", "GRADSYNC_STORE_PORT": str(store.port),
                    "GRADSYNC_LAUNCHER_PID": str(os.getpid()), "GRADSYNC_ELASTIC_ID": worker,
                    "GRADSYNC_ELASTIC_TIMEOUT": "60", "GRADSYNC_SECRET": "5e" * 32,
                    "GS_TEST_DEADLINE": "35",  # stacks dumped before the 40 s below
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        procs[worker] = start_process([sys.executable, str(RANKS / "elastic_split.py")], env,
                                      merge_stderr=True, text=True)

    def until(ready, what: str, seconds: float = 30.0) -> None:
        end = time.monotonic() + seconds
        while not ready():
            assert time.monotonic() < end, f"{what} within {seconds:g} s"
            time.sleep(0.05)

    try:
        gens.publish([b, a], now=False)
        start("a")  # rank 1 of generation 0: it posts its entry, then waits for b's table
        until(lambda: gens.control.world_store(0).check("peers/1"), "a waits in generation 0")
        began = time.monotonic()
        assert gens.publish([b, a, c], now=False) == 1  # c is ready before 0 formed
        start("b")
        start("c")
        deadline, outputs = began + 40, {}
        try:
            for w, p in procs.items():
                outputs[w] = p.proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.signal(signal.SIGKILL)
            raise AssertionError("the workers passed their 40 s deadline:\n" + "\n".join(
                report(f"--- {w} ---", p.proc.communicate()[0]) for w, p in procs.items()))
        took = time.monotonic() - began
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.signal(signal.SIGKILL)
                p.proc.wait()
    text = "\n".join(report(f"--- {w} ---", out) for w, out in outputs.items())
    assert all(p.proc.returncode == 0 for p in procs.values()), text
    formed = {w: re.search(r"FORMED (.*)", out).group(1) for w, out in outputs.items()}
    assert formed == {"b": "id=b gen=1 rank=0 size=3 sum=6",
                      "a": "id=a gen=1 rank=1 size=3 sum=6",
                      "c": "id=c gen=1 rank=2 size=3 sum=6"}, text
    assert "worker a: generation 0 failed to form (rank -1 reported: generation 0 was replaced " \
           "by generation 1 before it formed); waiting for the next" in outputs["a"], text
    assert took < 20, text  # two starts of a process and one connect; a's timeout is 60 s
    assert said == []


@pytest.mark.slow
def test_an_exception_in_one_rank_is_a_lost_worker():
    result = job(4, "raise", 1, 5)
    check_consistent(result, ["localhost[0]", "localhost[2]", "localhost[3]"], 3)
    assert "worker 1 fails on purpose" in result.output
    # it exits with status 1, unless exiting takes longer than the launcher's grace (a loaded
    # machine): then the launcher kills it
    assert re.search(r"worker localhost\[1\] (\(rank 1 of generation 0\) exited with status 1|"
                     r"was reported lost by its peers)", result.output), result


def walls(output: str, tag: str) -> list[float]:
    """The ``wall=`` times of the ``tag`` lines, in output order."""
    return [float(t) for t in re.findall(tag + r" wall=([0-9.]+)", output)]


# Scheduling slack on a loaded 2-core machine, on top of the heartbeat's own bound.
DETECTION_MARGIN = 2.0


@pytest.mark.slow
def test_a_stopped_rank_is_found_by_heartbeats_killed_and_left_out():
    result = job(4, "stop", 3, 5, env=FAST_HEARTBEAT)
    check_consistent(result, ["localhost[0]", "localhost[1]", "localhost[2]"], 3)
    assert "sent no heartbeat for" in result.output
    assert "worker localhost[3] (rank 3 of generation 0) sent no heartbeats and was killed" \
        in result.output, result
    # Detected within the heartbeat bound (docs/elastic.md, gradsync/liveness/heartbeat.py): a
    # watcher declares the peer lost within timeout + 2 intervals of its last beat, which came
    # before the DYING line, and the others see the record within the 0.1 s abort poll. No earlier
    # than timeout - interval after the stop (its last beat was at most an interval before
    # it), less a second for a heartbeat thread the load delayed.
    timeout = float(FAST_HEARTBEAT["GRADSYNC_HEARTBEAT_TIMEOUT"])
    interval = float(FAST_HEARTBEAT["GRADSYNC_HEARTBEAT_INTERVAL"])
    [stopped] = walls(result.output, "DYING")
    lost = walls(result.output, "LOST")
    assert len(lost) == 3, result  # one roll-back per survivor
    delays = [t - stopped for t in lost]
    assert min(delays) >= timeout - interval - 1.0, (delays, result)
    assert max(delays) <= timeout + 2 * interval + 0.1 + DETECTION_MARGIN, (delays, result)


@pytest.mark.slow
def test_the_lowest_rank_dies_and_a_survivor_becomes_rank_0():
    # with rollback = "always" (Horovod's rule): back to the new rank 0's last commit
    result = job(4, "kill", 0, 7, env={"ELASTIC_ROLLBACK": "always"})
    got = check_consistent(result, ["localhost[1]", "localhost[2]", "localhost[3]"], 3)
    assert got["localhost[1]"]["rank"] == "0"
    # the epoch never goes back past the last commit (6 batches an epoch at size 4)
    check_rolled_back(result.output, "localhost[1]", 7, 96 // 4 // 4)
    assert re.search(r"PLAN action=rollback updates=\d+ lost=\d+", result.output), result


@pytest.mark.slow
@pytest.mark.parametrize("mode, survivors", [
    ("kill-commit", ["localhost[0]", "localhost[2]", "localhost[3]"]),
    # kill-sync: worker 1 dies mid-step, then worker 2 (rank 1 of generation 1) in sync()
    ("kill-sync", ["localhost[0]", "localhost[3]"]),
])
def test_a_failure_during_commit_or_sync(mode, survivors):
    result = job(4, mode, 1, 5)
    check_consistent(result, survivors, len(survivors))


@pytest.mark.slow
def test_scale_up_through_the_discovery_script(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    result = launch(2, "elastic_train.py", "grow", "0", "4", timeout=240,
                    env={"HOSTS_FILE": str(hosts)},
                    launcher_args=("--min-np", "1", "--max-np", "3", "--host-discovery-script",
                                   f"cat {hosts}"))
    got = check_consistent(result, ["localhost[0]", "localhost[1]", "127.0.0.1[2]"], 3)
    # the new worker started from another seed: equal digests mean it received the state
    assert got["127.0.0.1[2]"]["rank"] == "2"
    assert "generation 1: 3 workers (2 kept, 1 new)" in result.output


@pytest.mark.slow
def test_localhost_and_127_0_0_1_are_two_hosts_and_only_the_failed_one_is_blacklisted(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("echo localhost:2\necho 127.0.0.1:3\n")
    # the survivors train on until the new worker has joined (a job that ended before then
    # would end without it)
    result = launch(4, "elastic_train.py", "kill", "1", "5", "3", timeout=240,
                    env={"TRAIN_UNTIL_SIZE": "3"},
                    launcher_args=("--min-np", "2", "--max-np", "4", "--host-discovery-script",
                                   f"sh {script}"))
    # worker 1 (localhost) dies: localhost is blacklisted and, as in Horovod, its other worker
    # leaves too; 127.0.0.1 keeps its two workers and takes a new one on its free slot
    got = check_consistent(result, ["127.0.0.1[2]", "127.0.0.1[3]", "127.0.0.1[4]"], 3)
    assert "host localhost is blacklisted" in result.output
    assert "stopping worker localhost[0]: host localhost is blacklisted" in result.output
    assert "host 127.0.0.1 is blacklisted" not in result.output
    # the survivors re-form at once; the new worker joins a later generation, once ready
    assert "generation 1: 2 workers (2 kept, 0 new)" in result.output, result
    assert "generation 2: 3 workers (2 kept, 1 new)" in result.output, result
    assert [got[w]["rank"] for w in ("127.0.0.1[2]", "127.0.0.1[3]", "127.0.0.1[4]")] == \
        ["0", "1", "2"]


@pytest.mark.slow
def test_below_min_np_ends_with_a_clear_error_after_the_elastic_timeout():
    result = job(3, "die-all", 0, 4, launcher=("--elastic-timeout", "3"))
    assert result.returncode != 0, result
    assert "no host to add within --elastic-timeout 3s: the job needs --min-np 2" in \
        result.output, result
    assert "RESULT" not in result.output


@pytest.mark.slow
def test_the_reset_limit_ends_the_job():
    result = job(3, "kill", 1, 4, launcher=("--reset-limit", "0"))
    assert result.returncode == 128 + 9, result
    assert "--reset-limit 0 reached" in result.output, result


@pytest.mark.slow
def test_elastic_digits_example_reaches_97_percent_with_a_worker_killed():
    from pathlib import Path

    example = str(Path(__file__).resolve().parent.parent / "examples" / "elastic_digits.py")
    result = launch(3, example, "--kill-rank", "1", "--kill-epoch", "3", timeout=400,
                    launcher_args=("--min-np", "2"))
    assert result.returncode == 0, result
    assert "worker 1 (rank 1) kills itself in epoch 3" in result.output, result
    epochs = re.findall(r"epoch +(\d+) .* size (\d)", result.output)
    assert [int(e) for e, _ in epochs] == list(range(1, 21)), result  # no epoch lost or repeated
    assert {s for e, s in epochs if int(e) >= 3} == {"2"}, result
    accuracy = float(re.search(r"final test accuracy ([0-9.]+) on 2 workers", result.output)[1])
    assert accuracy >= 0.97, result


@pytest.mark.slow
def test_under_torchrun_a_lost_worker_restarts_the_group_from_its_checkpoint(tmp_path):
    # a real torchrun (--nnodes MIN:MAX): no in-place re-formation there; hvd.elastic.run
    # re-raises the lost peer, the ranks exit and torchrun restarts all of them
    import os
    from pathlib import Path

    ranks = Path(__file__).resolve().parent / "ranks"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"GS_TEST_DEADLINE": "200", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "3", "--max-restarts", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf", "last_call_timeout=1",
           "--monitor-interval", "0.2", str(ranks / "elastic_torchrun.py"),
           str(tmp_path / "checkpoint.pt"), "1", "4"]
    # the deadline covers the workers too: torchrun starts them in sessions of their own
    done = run_job(cmd, env=env, cwd=ranks, timeout=240)
    out = done.stdout
    assert done.returncode == 0, out[-6000:]
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1", out), out[-6000:]
    resumed = re.findall(r"RESUMED restart=(\d) rank=(\d) epoch=(\d)", out)
    # the first attempt starts at epoch 0; the restart at the checkpoint of the last finished
    # epoch (worker 1 died in epoch 2), never earlier
    assert sorted(resumed) == [("0", r, "0") for r in "012"] + [("1", r, "2") for r in "012"]
    got = re.findall(r"RESULT restart=(\d) rank=(\d) size=(\d) epoch=(\d) hash=([0-9a-f]+)", out)
    assert sorted(g[:4] for g in got) == [("1", r, "3", "4") for r in "012"], out[-6000:]
    assert len({g[4] for g in got}) == 1, out[-6000:]  # identical parameters


@pytest.mark.slow
def test_remote_workers_start_over_ssh_leave_with_their_host_and_join_when_discovered(
        tmp_path):
    # hostA and hostB are other hosts to the launcher: their workers start through an ssh
    # stand-in that runs them in sessions of their own (tests/harness.py remote_ssh), so only
    # ssh (its exit, its stdin: the lifeline) connects them to the launcher
    ssh, log = remote_ssh(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\nhostA:2\n")
    result = launch(4, "elastic_train.py", "kill-grow", "3", "5", timeout=300,
                    env={"HOSTS_FILE": str(hosts), "GROW_HOST": "hostB:1",
                         "FAKE_SSH_LOG": str(log)},
                    launcher_args=("--min-np", "2", "--max-np", "5", "--host-discovery-script",
                                   f"cat {hosts}", "--ssh-command", str(ssh), "-x",
                                   "GS_TEST_DEADLINE", "-x", "HOSTS_FILE", "-x", "GROW_HOST"))
    # hostA[3] dies mid-step: hostA is blacklisted and hostA[2] stopped; localhost goes on at
    # 2, then worker 0 lists hostB, whose worker joins with the job's parameters
    got = check_consistent(result, ["localhost[0]", "localhost[1]", "hostB[4]"], 3)
    out = result.output
    assert "worker hostA[3] (rank 3 of generation 0) exited with status 137" in out, result
    assert "stopping worker hostA[2]: host hostA is blacklisted" in out, result
    assert "generation 1: 2 workers (2 kept, 0 new)" in out, result
    assert "generation 2: 3 workers (2 kept, 1 new)" in out, result
    assert got["hostB[4]"]["rank"] == "2"
    first = starts(out, "0")
    assert sorted(first) == ["hostA[2]", "hostA[3]", "localhost[0]", "localhost[1]"], result
    # the stopped remote worker is gone: its lifeline ended it when ssh's stdin closed
    assert gone(first["hostA[2]"]["pid"]) and gone(first["hostA[3]"]["pid"])
    # per remote host one reachability check, then one ssh per worker; no local worker
    calls = re.findall(r"-o ConnectTimeout=\d+ (\S+) (\S+)", log.read_text())
    assert sorted(h for h, _ in calls) == ["hostA", "hostA", "hostA", "hostB", "hostB"]
    assert sorted(c for _, c in calls).count("true") == 2


@pytest.mark.slow
def test_a_rank_that_re_forms_first_takes_the_ranks_still_waiting_in_an_allreduce_along(
        tmp_path):
    # Worker 0 adds a host and re-forms for it (the host update check_host_updates raises)
    # while worker 1 waits in the step's allreduces, which worker 0 never starts: worker 0's
    # abandonment of generation 0 is that generation's abort record, and worker 1 must take
    # it as a lost peer and re-form too, not end the job (as it did when a stopped host's
    # peers raced the update, session 15).
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    result = launch(2, "elastic_train.py", "interrupt", "0", "4", "1", timeout=240,
                    env={"HOSTS_FILE": str(hosts), "TRAIN_UNTIL_SIZE": "3"},
                    launcher_args=("--min-np", "1", "--max-np", "3", "--host-discovery-script",
                                   f"cat {hosts}"))
    check_consistent(result, ["localhost[0]", "localhost[1]", "127.0.0.1[2]"], 3)
    assert "generation 0 lost a worker (rank 0 reported: rank 0 left generation 0 to re-form " \
           "the elastic job" in result.output, result


@pytest.mark.slow
def test_a_remote_host_that_leaves_discovery_loses_its_workers_through_the_lifeline(tmp_path):
    ssh, log = remote_ssh(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\nhostC:2\n")
    result = launch(4, "elastic_train.py", "shrink", "0", "5", timeout=300,
                    env={"HOSTS_FILE": str(hosts), "SHRINK_HOSTS": "localhost:2",
                         "FAKE_SSH_LOG": str(log)},
                    launcher_args=("--min-np", "2", "--host-discovery-script", f"cat {hosts}",
                                   "--ssh-command", str(ssh), "-x", "GS_TEST_DEADLINE"))
    # worker 0 drops hostC from the discovery file at step 5: its two workers are stopped
    # (through ssh: the lifeline) and localhost's go on with identical parameters
    check_consistent(result, ["localhost[0]", "localhost[1]"], 2)
    out = result.output
    for worker in ("hostC[2]", "hostC[3]"):
        assert f"stopping worker {worker}: host hostC is no longer listed" in out, result
    assert "generation 1: 2 workers (2 kept, 0 new)" in out, result
    assert "blacklisted" not in out, result  # leaving discovery is not a failure
    first = starts(out, "0")
    assert gone(first["hostC[2]"]["pid"]) and gone(first["hostC[3]"]["pid"]), result
