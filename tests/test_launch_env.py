"""launch_env.detect: each launcher's variables -> LaunchEnv, and the errors for bad values."""

import socket

import pytest

from gradsync.cluster.launch_env import detect, slurm_first_host, slurm_tasks_per_node
from gradsync.config import Config, load_config
from gradsync.errors import ConfigError

SECRET = bytes(range(32))


def gradsync_vars(rank=1, **extra):
    env = {"GRADSYNC_RANK": str(rank), "GRADSYNC_SIZE": "4", "GRADSYNC_LOCAL_RANK": "1",
           "GRADSYNC_LOCAL_SIZE": "2", "GRADSYNC_CROSS_RANK": "0", "GRADSYNC_CROSS_SIZE": "2",
           "GRADSYNC_HOSTNAME": "hostA", "GRADSYNC_STORE_ADDR": "10.0.0.1",
           "GRADSYNC_STORE_PORT": "29400", "GRADSYNC_SECRET": SECRET.hex(),
           "GRADSYNC_JOB_ID": "job7", "GRADSYNC_LAUNCHER_PID": "4242"}
    env.update(extra)
    return env


def torchrun_vars(rank=3, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2), "GROUP_WORLD_SIZE": "2",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    env.update(extra)
    return env


def slurm_vars(rank=5, **extra):
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "8", "SLURM_LOCALID": str(rank % 4),
           "SLURM_NODEID": str(rank // 4), "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_ID": "81234", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURMD_NODENAME": f"node0{7 + rank // 4}"}
    env.update(extra)
    return env


def ompi_vars(rank=2, **extra):
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "3",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
           "MASTER_ADDR": "head", "MASTER_PORT": "29600"}
    env.update(extra)
    return env


# ---------------------------------------------------------------- each source
def test_single_process_hosts_its_own_store_on_loopback():
    env = detect({})
    assert (env.source, env.rank, env.size, env.local_rank, env.local_size) == \
        ("single", 0, 1, 0, 1)
    assert env.store_is_server and env.store_addr == "127.0.0.1" and 0 < env.store_port < 65536
    assert env.hostname == socket.gethostname() and env.secret is None


def test_gradsync_variables_give_every_field():
    env = detect(gradsync_vars())
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank,
            env.cross_size) == (1, 4, 1, 2, 0, 2)
    assert (env.hostname, env.store_addr, env.store_port) == ("hostA", "10.0.0.1", 29400)
    assert (env.secret, env.job_id, env.source, env.launcher_pid) == \
        (SECRET, "job7", "gradsync", 4242)
    assert env.store_is_server is False  # gradsync run hosts the store
    assert repr(SECRET) not in repr(env)  # a logged LaunchEnv must not leak the secret


def test_gradsync_variables_without_launcher_make_rank0_the_store_host():
    environ = gradsync_vars(rank=0)
    del environ["GRADSYNC_LAUNCHER_PID"]
    assert detect(environ).store_is_server is True
    environ["GRADSYNC_RANK"] = "1"
    assert detect(environ).store_is_server is False


def test_gradsync_variables_need_the_store_address():
    environ = gradsync_vars()
    del environ["GRADSYNC_STORE_PORT"]
    with pytest.raises(ConfigError, match="GRADSYNC_STORE_PORT"):
        detect(environ)


def test_bad_secret_is_named_but_not_echoed():
    with pytest.raises(ConfigError, match="GRADSYNC_SECRET") as info:
        detect(gradsync_vars(GRADSYNC_SECRET="not-hex-secret-value"))
    assert "not-hex-secret-value" not in str(info.value)


def test_torchrun_rank0_hosts_the_store_unless_the_agent_does():
    env = detect(torchrun_vars(rank=0))
    assert env.source == "torchrun" and env.store_is_server is True
    assert (env.store_addr, env.store_port, env.job_id) == ("node1", 29500, "abc.0")
    assert detect(torchrun_vars(rank=0, TORCHELASTIC_USE_AGENT_STORE="True")).store_is_server \
        is False
    assert detect(torchrun_vars(rank=1)).store_is_server is False


def test_torchrun_identity_and_restart_prefix():
    env = detect(torchrun_vars(rank=3, TORCHELASTIC_RESTART_COUNT="2"))
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank,
            env.cross_size) == (3, 4, 1, 2, 1, 2)
    assert env.job_id == "abc.2"  # a restarted attempt must not see the old attempt's keys
    assert env.hostname == socket.gethostname()
    assert detect(torchrun_vars(GRADSYNC_HOSTNAME="h9")).hostname == "h9"


def test_torchrun_uneven_nodes_leave_cross_ranks_to_the_rendezvous():
    env = detect(torchrun_vars(rank=2, WORLD_SIZE="3", GROUP_RANK="1"))
    assert (env.local_size, env.cross_rank, env.cross_size) == (2, None, None)


def test_plain_env_init_without_torchrun_extras():
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (env.source, env.local_rank, env.local_size, env.cross_rank) == \
        ("torchrun", None, None, None)
    assert env.job_id == "torch-h-1234.0"


def test_slurm_identity_store_and_host():
    env = detect(slurm_vars(rank=5))
    assert env.source == "slurm"
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank,
            env.cross_size) == (5, 8, 1, 4, 1, 2)
    assert (env.hostname, env.store_addr, env.store_is_server) == ("node08", "node07", False)
    assert env.job_id == "slurm-81234"
    # Every rank derives the same port from the job id, and a new step gets another one.
    assert detect(slurm_vars(rank=0)).store_port == env.store_port
    assert detect(slurm_vars(rank=0)).store_is_server is True
    assert 15000 <= env.store_port < 30000
    assert detect(slurm_vars(SLURM_STEP_ID="1")).store_port != env.store_port


def test_slurm_store_overrides_and_uneven_nodes():
    env = detect(slurm_vars(MASTER_ADDR="n0", MASTER_PORT="2000", GRADSYNC_STORE_PORT="3000"))
    assert (env.store_addr, env.store_port) == ("n0", 3000)
    env = detect(slurm_vars(rank=4, SLURM_NTASKS="5", SLURM_TASKS_PER_NODE="4,1",
                            SLURM_LOCALID="0"))
    assert (env.local_size, env.cross_rank, env.cross_size) == (1, None, None)


def test_slurm_rank0_off_the_first_node_cannot_host_the_derived_store():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        detect(slurm_vars(rank=0, SLURM_NODEID="1"))


def test_mpirun_needs_the_store_address():
    env = detect(ompi_vars())
    assert (env.source, env.rank, env.size, env.local_rank, env.local_size) == \
        ("mpirun", 2, 3, 0, 1)
    assert (env.store_addr, env.store_port, env.store_is_server) == ("head", 29600, False)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        detect(ompi_vars(MASTER_ADDR="", MASTER_PORT=""))


def test_mpirun_inside_an_sbatch_allocation_ignores_the_batch_step():
    # mpirun's ranks inherit SLURM_PROCID=0 of the batch script; the MPI rank is the truth.
    environ = {**slurm_vars(rank=0, SLURM_NTASKS="3"), **ompi_vars(rank=2)}
    env = detect(environ)
    assert (env.source, env.rank) == ("mpirun", 2)
    # srun direct launch, where both agree, stays slurm.
    assert detect({**slurm_vars(rank=2, SLURM_NTASKS="3", SLURM_TASKS_PER_NODE="3",
                                SLURM_NODEID="0", SLURM_LOCALID="2"),
                   **ompi_vars(rank=2)}).source == "slurm"


def test_priority_gradsync_then_torchrun_then_slurm():
    everything = {**slurm_vars(), **torchrun_vars(), **gradsync_vars()}
    assert detect(everything).source == "gradsync"
    del everything["GRADSYNC_RANK"], everything["GRADSYNC_SIZE"]
    assert detect(everything).source == "torchrun"


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize("environ, variable, value", [
    (gradsync_vars(GRADSYNC_RANK="4"), "GRADSYNC_RANK", "4"),
    (gradsync_vars(GRADSYNC_RANK="-1"), "GRADSYNC_RANK", "-1"),
    (gradsync_vars(GRADSYNC_SIZE="four"), "GRADSYNC_SIZE", "four"),
    (gradsync_vars(GRADSYNC_SIZE="0"), "GRADSYNC_SIZE", "0"),
    (gradsync_vars(GRADSYNC_LOCAL_RANK="2"), "GRADSYNC_LOCAL_RANK", "2"),
    (gradsync_vars(GRADSYNC_LOCAL_SIZE="5"), "GRADSYNC_LOCAL_SIZE", "5"),
    (gradsync_vars(GRADSYNC_CROSS_RANK="2"), "GRADSYNC_CROSS_RANK", "2"),
    (gradsync_vars(GRADSYNC_STORE_PORT="70000"), "GRADSYNC_STORE_PORT", "70000"),
    (torchrun_vars(RANK="4"), "RANK", "4"),
    (torchrun_vars(LOCAL_RANK="1.5"), "LOCAL_RANK", "1.5"),
    (torchrun_vars(MASTER_PORT="http"), "MASTER_PORT", "http"),
    (slurm_vars(SLURM_PROCID="9"), "SLURM_PROCID", "9"),
    (slurm_vars(SLURM_LOCALID="4"), "SLURM_LOCALID", "4"),
    (ompi_vars(OMPI_COMM_WORLD_RANK="x"), "OMPI_COMM_WORLD_RANK", "x"),
])
def test_inconsistent_values_name_the_variable_and_value(environ, variable, value):
    with pytest.raises(ConfigError) as info:
        detect(environ)
    assert variable in str(info.value) and value in str(info.value)


def test_rank_without_size_is_an_error():
    with pytest.raises(ConfigError, match="GRADSYNC_SIZE"):
        detect({"GRADSYNC_RANK": "0"})


# ---------------------------------------------------------------- parameter-server roles
def test_no_parameter_servers_by_default():
    env = detect(gradsync_vars(rank=3))
    assert (env.servers, env.workers, env.is_server, env.server_rank) == (0, 4, False, None)
    single = detect({})
    assert (single.servers, single.workers, single.is_server) == (0, 1, False)
    assert detect(gradsync_vars(GRADSYNC_SERVERS="")).servers == 0  # exported but empty: unset


@pytest.mark.parametrize("environ, source, servers, workers, server_rank", [
    (gradsync_vars(rank=3, GRADSYNC_SERVERS="2"), "gradsync", 2, 2, 1),
    (torchrun_vars(rank=3, GRADSYNC_SERVERS="1"), "torchrun", 1, 3, 0),
    (slurm_vars(rank=5, GRADSYNC_SERVERS="3"), "slurm", 3, 5, 0),
    (ompi_vars(rank=2, GRADSYNC_SERVERS="2"), "mpirun", 2, 1, 1),
])
def test_servers_are_read_under_every_source(environ, source, servers, workers, server_rank):
    env = detect(environ)
    assert (env.source, env.servers, env.workers, env.is_server, env.server_rank) == \
        (source, servers, workers, True, server_rank)


def test_servers_are_the_last_ranks():
    roles = [detect(gradsync_vars(rank=r, GRADSYNC_SIZE="5", GRADSYNC_SERVERS="2"))
             for r in range(5)]
    assert [(e.workers, e.is_server, e.server_rank) for e in roles] == \
        [(3, False, None)] * 3 + [(3, True, 0), (3, True, 1)]


def test_servers_variable_is_not_a_config_setting():
    assert load_config(environ={"GRADSYNC_SERVERS": "1"}) == Config()


@pytest.mark.parametrize("environ, value, size", [
    (gradsync_vars(GRADSYNC_SERVERS="-1"), "-1", "4 ranks"),
    (gradsync_vars(GRADSYNC_SERVERS="two"), "two", "4 ranks"),
    (torchrun_vars(GRADSYNC_SERVERS="1.5"), "1.5", "4 ranks"),
    (gradsync_vars(GRADSYNC_SERVERS="4"), "4", "4 ranks"),
    (slurm_vars(GRADSYNC_SERVERS="9"), "9", "8 ranks"),
    ({"GRADSYNC_SERVERS": "1"}, "1", "1 rank"),  # a single process is its only worker
])
def test_bad_servers_name_the_variable_value_and_size(environ, value, size):
    with pytest.raises(ConfigError) as info:
        detect(environ)
    message = str(info.value)
    assert f"GRADSYNC_SERVERS={value}" in message.replace("'", "") and f"of {size}" in message
    if value.isdigit():
        assert "leaves no worker" in message


# ---------------------------------------------------------------- SLURM formats
@pytest.mark.parametrize("nodelist, first", [
    ("node[01-04],gpu7", "node01"),
    ("gpu7,node[1-2]", "gpu7"),
    ("rack1-n[3,5-6]-ib", "rack1-n3-ib"),
    ("solo", "solo"),
])
def test_first_host_of_a_node_list(nodelist, first):
    assert slurm_first_host(nodelist) == first


def test_unreadable_node_list_says_what_to_export():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        slurm_first_host("r[1-2]n[1-4]")


@pytest.mark.parametrize("text, counts", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), ("2(x", None),
])
def test_tasks_per_node(text, counts):
    assert slurm_tasks_per_node(text) == counts
