"""bench/swarm_sim.py, run small: the peers' real decision code (modelcache/peers/plan.py) on
simulated links and virtual time. Nothing here is timed (the clock is virtual); the bench's own
runs (docs/peers.md) measure 100 and 1,000 nodes. These check that the simulator keeps working as
the decision code changes, that it reports the issue's keys, that a swarm reads the origin about
once per zone where nodes without peers read it once each, and that the validation against
bench/fleet.py's real run can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, load_script

#: The keys the issue's --json names.
ISSUE_KEYS = ("nodes", "zones", "time_vs_single", "origin_per_zone_vs_model", "validated_against_fleet")
MiB = 1 << 20


@pytest.fixture(scope="module")
def sim() -> Any:
    return load_script("bench/swarm_sim.py", "swarm_sim_bench")


def world(sim: Any, **kw: Any) -> Any:
    return sim.World(**{"nodes": 6, "zones": 2, "files": sim.model_sizes(96 * MiB, 4), "origin_stream": 50e6, **kw})


def test_a_swarm_reads_the_origin_about_once_per_zone_without_peers_once_per_node(sim: Any) -> None:
    out = sim.scenario(world(sim))
    assert out["nodes"] == 6 and out["zones"] == 2 and len(out["origin_per_zone"]) == 2
    # Each zone reads the model from the origin at most about once (owners are per zone; a piece
    # another zone's node holds already is taken from it), and every byte at least once ...
    assert all(z <= 1.1 for z in out["origin_per_zone"]) and sum(out["origin_per_zone"]) >= 1.0, out
    # ... and is not much slower than one node alone (pieces pass on as they arrive).
    assert 0.5 < out["time_vs_single"] <= 1.5, out
    assert out["most_polling"] <= 5  # nobody polls itself; every other node of the 6 at most
    direct = sim.simulate(world(sim, peers=False))
    assert [round(z, 2) for z in direct["origin_per_zone"]] == [3.0, 3.0]  # 3 nodes a zone, each all of it


def test_the_same_world_gives_the_same_result(sim: Any) -> None:
    a, b = sim.simulate(world(sim, nodes=4, zones=1)), sim.simulate(world(sim, nodes=4, zones=1))
    assert (a["seconds"], a["origin_bytes"], a["events"]) == (b["seconds"], b["origin_bytes"], b["events"])


def test_the_peer_cap_bounds_who_polls_whom(sim: Any) -> None:
    out = sim.simulate(world(sim, nodes=12, zones=1, settings={"max_peers": 3}))
    assert out["most_polling"] <= 3  # SwarmSettings.max_peers, applied by plan.choose_peers


def test_validation_against_fleet_passes_within_15_percent_and_fails_outside(sim: Any) -> None:
    base = world(sim, nodes=2, zones=1)
    # What the simulation itself says of bench/fleet.py's world: a "real" run equal to it passes ...
    fleet = {"nodes": 2, "model_bytes": sum(sim.model_sizes(32 * MiB, 4)), "origin_rate": 8 * MiB}
    simulated = sim.scenario(sim.fleet_world(fleet, base))
    same = {**fleet, "seconds_single": 10.0, "seconds_p2p": 10.0 * simulated["time_vs_single"],
            "origin_bytes_p2p": fleet["model_bytes"] * simulated["origin_per_zone_vs_model"]}
    check = sim.validate(same, base)
    assert check["ok"] and check["relative_error"] == {"time_vs_single": 0.0, "origin_vs_model": 0.0}
    # ... one whose origin read twice the model, or took 1.3x as long, does not.
    assert not sim.validate({**same, "origin_bytes_p2p": 2 * same["origin_bytes_p2p"]}, base)["ok"]
    assert not sim.validate({**same, "seconds_p2p": 1.3 * same["seconds_p2p"]}, base)["ok"]


def test_the_command_line_writes_the_issues_json(sim: Any, tmp_path: Path) -> None:
    # What it validates against by default: bench/fleet.py's recorded runs at 8 and 16 nodes. Here
    # the same runs with their model cut to 16 MiB (same nodes, origin, machine, agents and costs):
    # the same path through --validate for a few CPU-s instead of ~50 (the fast lane's heaviest).
    assert [p.name for p in sim.FLEET_RESULTS] == ["fleet-8-stop39.json", "fleet-16-stop39.json"]
    small = []
    for path in sim.FLEET_RESULTS:
        small.append(tmp_path / path.name)
        small[-1].write_text(json.dumps({**json.loads(path.read_text()), "model_bytes": 16 * MiB}))
    # The 8-node run as bench/fleet.py records it now: each agent's CPU beside each probe sample
    # (here 0.1 cores each, all the time); the 16-node one as runs were recorded before, without.
    eight, sixteen = (json.loads(path.read_text()) for path in small)
    eight["agents_during_p2p"] = steady_agents(eight["cpu_share_during_p2p"], list(eight["agents_p2p"]), 0.1)
    sixteen.pop("agents_during_p2p", None)
    for path, fleet in zip(small, (eight, sixteen), strict=True):
        path.write_text(json.dumps(fleet))
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "swarm_sim.py"), "--nodes", "3", "--zones", "1",
                           "--size", "48Mi", "--json", str(out), "--validate", *map(str, small)], check=True,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"})
    result = json.loads(out.read_text())
    assert set(ISSUE_KEYS) <= set(result) and result["nodes"] == 3 and result["zones"] == 1
    # Whether they pass is a measured result (docs/benchmarks.md), not this test's to decide.
    checks = result["validation"]
    assert [check["nodes"] for check in checks] == [8, 16]
    assert result["validated_against_fleet"] is all(check["ok"] for check in checks)
    for check in checks:
        assert set(check["relative_error"]) == {"time_vs_single", "origin_vs_model"}
        assert check["polls_answered"]["fleet"] > 0 and check["polls_answered"]["simulated"] > 0
    # The agents' cores per window beside the model's offer, where recorded; an old run has none.
    windows = checks[0]["cpu_per_window"]
    assert len(windows["windows"]) == len(eight["cpu_share_during_p2p"]) and windows["agents"] == 8
    assert all(w["used_probe_window"] == pytest.approx(0.1, abs=0.002) for w in windows["windows"]), windows
    assert checks[1]["cpu_per_window"] is None
    assert "8 nodes: each agent's cores per probe window" in done.stderr and "16 nodes:" not in done.stderr


def steady_agents(samples: list[list[float]], names: list[str], cores: float) -> dict[str, Any]:
    """bench/fleet.py's ``agents_during`` beside ``samples`` for agents that each use ``cores``
    all the time (each probe window 1 s long)."""
    at = [[t, t + 1.0] for t, _, _ in samples]
    return {"at": at, "cpu_seconds": {n: [[round(cores * a, 4), round(cores * b, 4)] for a, b in at] for n in names},
            "sent_bytes": {n: [0] * len(at) for n in names}, "metrics_read_seconds": [0.01] * len(at)}


def test_the_agents_cores_per_window_are_set_beside_the_models_offer(sim: Any) -> None:
    """Two samples of the probe on 2 cores: 6 other runnable threads at first (a share of 0.2
    with 3 agents' threads seen: 2 / 0.2 - 1 - 3), none later (a whole core, one agent's thread
    seen). 2 agents with work are offered 2 / (6 + 2) = 0.25 cores each, then 1 core each (2 / 2,
    their GIL's bound too); one used 0.1 and then 0.5 cores, the other 0.3 and then 0.5."""
    fleet = {"nodes": 2, "cpus": 2, "cpu_share_during_p2p": [[0.0, 0.2, 3.0], [2.0, 1.0, 1.0]],
             "agents_during_p2p": {"at": [[0.0, 1.0], [2.0, 3.0]],
                                   "cpu_seconds": {"a": [[0.0, 0.1], [0.2, 0.7]], "b": [[0.0, 0.3], [0.6, 1.1]]}}}
    out = sim.cpu_per_window(fleet, sim.World(nodes=2, zones=1, files=(1,), cpus=2, gil=1.0))
    first, second = out["windows"]
    assert (first["others"], first["offered"], second["others"], second["offered"]) == (6.0, 0.25, 0.0, 1.0)
    assert first["used_probe_window"] == pytest.approx(0.2) and second["used_probe_window"] == pytest.approx(0.5)
    assert first["used_to_next"] == pytest.approx(0.2)  # 0.8 CPU-s from 0 s to 2 s, 2 agents
    assert second["used_to_next"] is None and first["used_over_offered"] == pytest.approx(0.8)
    # In all: 0.25 x 2 agents x 2 s offered, then 1 x 2 x 1 s (the last sample's window); used 0.8 + 1.0.
    assert out["total"]["offered_cpu_seconds"] == pytest.approx(3.0)
    assert out["total"]["used_cpu_seconds"] == pytest.approx(1.8)
    # The simulation's own agents beside them: its samples of their cores (all agents together),
    # averaged over each step; one that finished before the last window has none there.
    traced = sim.cpu_per_window(fleet, sim.World(nodes=2, zones=1, files=(1,), cpus=2, gil=1.0),
                                trace=[(0.0, 0.4), (0.05, 0.6), (2.0, 1.0), (2.05, 1.0)])
    assert [w["simulated"] for w in traced["windows"]] == [0.25, 0.5]
    assert traced["total"]["simulated_cpu_seconds"] == pytest.approx(0.25 * 2 * 0.1 + 0.5 * 2 * 0.1)
    early = sim.cpu_per_window(fleet, sim.World(nodes=2, zones=1, files=(1,), cpus=2, gil=1.0), trace=[(0.0, 0.4)])
    assert [w["simulated"] for w in early["windows"]] == [0.2, None]
    # A run recorded before the series (its agents' totals only), or one without samples: none.
    old = json.loads((REPO / "bench" / "fleet-8-stop39.json").read_text())
    assert sim.cpu_per_window(old, sim.fleet_world(old, world(sim))) is None
    assert sim.cpu_per_window({**fleet, "cpu_share_during_p2p": []}, sim.World(nodes=2, zones=1, files=(1,))) is None


def test_the_cpu_model_slows_a_swarm_as_its_cpu_work_over_the_cores_it_gets(sim: Any) -> None:
    """Agents sharing one machine's cores (bench/fleet.py's run): a swarm whose CPU work is the
    limit takes about that work over the cores, twice as long on half the cores (as many other
    processes running as agents), and a fleet (each node its own core) much less; no CPU
    model: the links' time alone."""
    per_byte = 1 / (64 * MiB)  # 1 CPU-s per 64 MiB taken in, half that per byte sent to a peer
    cpu = {"cpu_pull": per_byte, "cpu_serve": per_byte / 2}
    free = sim.simulate(world(sim, nodes=4, zones=1))
    shared = sim.simulate(world(sim, nodes=4, zones=1, cpus=1, cpu_shared=True, **cpu))
    model = sum(sim.model_sizes(96 * MiB, 4))
    assert shared["peer_bytes"] > 2 * model  # most of the model from peers: their sending costs CPU too
    work = 4 * model * cpu["cpu_pull"] + shared["peer_bytes"] * cpu["cpu_serve"]  # CPU-s in all
    # At most half as long again: an agent whose flows wait on a sender's CPU still counts as
    # runnable and holds its share (the model's pessimism: 1.42x here, 1.0-1.25x with one pool).
    assert work <= shared["seconds"] <= 1.5 * work, (work, shared["seconds"])
    assert shared["seconds"] > 3 * free["seconds"]
    # A busy machine: one more process got a fifth of the core, so 4 others run; with the 4 agents
    # running too they get half of it together: about twice the time.
    assert sim.others_before(1.0, 0.2) == pytest.approx(4.0)
    busy = sim.simulate(world(sim, nodes=4, zones=1, cpus=1, cpu_shared=True, cpu_share=0.2, **cpu))
    assert 1.7 <= busy["seconds"] / shared["seconds"] <= 2.2, (busy["seconds"], shared["seconds"])
    # Its agents' cores sampled as it runs: never more than the machine's core, and over the run
    # they add up to the CPU work (0.05 s apart: within a few percent); the run itself unchanged.
    times = tuple(round(0.05 * i, 2) for i in range(int(shared["seconds"] / 0.05) + 1))
    traced = sim.simulate(world(sim, nodes=4, zones=1, cpus=1, cpu_shared=True, cpu_trace=times, **cpu))
    assert traced["seconds"] == shared["seconds"] and shared["cpu_trace"] == []
    assert len(traced["cpu_trace"]) == len(times) and max(c for _, c in traced["cpu_trace"]) <= 1.0 + 1e-9
    assert sum(c for _, c in traced["cpu_trace"]) * 0.05 == pytest.approx(work, rel=0.05)
    # A fleet: the same costs on a core per node.
    fleet = sim.simulate(world(sim, nodes=4, zones=1, cpus=1, **cpu))
    assert free["seconds"] < fleet["seconds"] < shared["seconds"] / 2
    # The origin figure is the links' and the plan's: the CPU model leaves it alone.
    assert shared["origin_bytes"] == free["origin_bytes"] == fleet["origin_bytes"]


def test_cpu_costs_come_from_the_fleet_runs_cpu_and_bytes(sim: Any) -> None:
    model = 256 * MiB
    fleet = {"nodes": 8, "model_bytes": model, "origin_rate": 16 * MiB, "agent_cpu_seconds_direct": 8 * 0.25,
             "agent_cpu_seconds_p2p": 8 * 0.25 + 1.5, "peer_bytes_p2p": 6 * model, "cpus": 2,
             "cpu_share_p2p": 0.25}
    costs = sim.cpu_costs(fleet)
    pull, serve = costs.pull, costs.serve
    assert round(pull * (1 << 30), 6) == 1.0 and round(serve * (1 << 30), 6) == 1.0  # CPU-s per GiB
    assert sim.costs_of([fleet]) == costs  # a run without its agents one by one: its totals
    world_ = sim.fleet_world(fleet, world(sim))
    assert (world_.cpus, world_.cpu_shared, world_.cpu_share) == (2.0, True, 0.25)
    # The probe's share is one more process's: 7 others (2 / 0.25 - 1). One agent with work gets
    # what the probe got, 8 agents with work a fair share of 2 cores beside the 7 (1.07 cores in
    # all); on an idle machine 8 agents get all 2 cores, one agent alone one core (its GIL).
    assert sim.others_before(2.0, 0.25) == pytest.approx(7.0) and sim.others_before(2.0, 0.0) == 0.0
    machine = sim.Machine(None, 2.0, 7.0, gil=1.0, idle=0.0)
    assert machine.share(1) == pytest.approx(0.25) and 8 * machine.share(8) == pytest.approx(16 / 15)
    idle_machine = sim.Machine(None, 2.0, 0.0, gil=1.0, idle=0.0)
    assert 8 * idle_machine.share(8) == pytest.approx(2.0) and idle_machine.share(1) == 1.0
    # A recorded run without the agents' CPU (the older bench/fleet.py): no CPU model.
    assert sim.fleet_world({k: v for k, v in fleet.items() if k != "cpu_share_p2p"}, world(sim)).cpus == 0.0


def test_cpu_costs_are_the_quiet_ones_times_what_the_runs_agents_paid_over_them(sim: Any) -> None:
    """Agents whose CPU is k times what their bytes and polls cost on a quiet machine: the
    contention is k, the costs the quiet ones times k (their ratios kept), the idle cores those
    the agents were measured to use; runs without their agents one by one give none."""
    gib = 1 << 30

    def run(nodes: int, k: float) -> dict[str, Any]:
        agents = {}
        for i in range(nodes):
            row = {"from_peers": (i % 3) * gib // 4, "from_origin": gib // 4 - (i % 3) * gib // 12,
                   "sent_bytes": (i * 37 % 11) * gib // 20, "polls_answered": 900 + (i * 53 % 7) * 150,
                   "idle_cpu_seconds_per_minute": 0.12 + 0.06 * (i % 2)}
            quiet = ((row["from_peers"] + row["from_origin"]) * sim.CPU_IN_PER_GIB
                     + row["sent_bytes"] * sim.CPU_SENT_PER_GIB) / gib
            quiet += row["polls_answered"] * sim.CPU_POLL_PER_1000 / 1000
            agents[f"n{i}"] = {**row, "cpu_seconds": k * quiet}
        return {"nodes": nodes, "agents_p2p": agents}

    assert sim.contention([run(8, 9.0)]) == pytest.approx(9.0)
    # Two runs together: their CPU over their quiet work, between the two.
    assert 6.0 < sim.contention([run(8, 9.0), run(16, 6.0)]) < 9.0
    costs = sim.costs_of([run(8, 9.0)])
    assert costs.pull * gib == pytest.approx(9.0 * sim.CPU_IN_PER_GIB)
    assert costs.serve * gib == pytest.approx(9.0 * sim.CPU_SENT_PER_GIB)
    assert costs.poll * 1000 == pytest.approx(9.0 * sim.CPU_POLL_PER_1000)
    assert costs.origin < 0  # a byte from the origin costs as one from a peer
    assert costs.idle == pytest.approx(0.15 / 60)  # the agents' mean, CPU-s a minute in cores
    assert sim.contention([{"seconds_p2p": 1.0}]) is None  # no agents recorded: nothing to measure


def test_an_agent_uses_at_most_one_core_and_a_shared_machine_gives_each_agent_with_work_a_runnable_share(
        sim: Any) -> None:
    """The GIL: an agent's work runs on one core whatever the cores of its node; on a shared
    machine each agent with work is one runnable thread beside the other processes'."""
    per_byte = 1 / (16 * MiB)  # CPU the limit: 1 CPU-s per 16 MiB taken in
    cpu = {"cpu_pull": per_byte, "cpu_serve": per_byte / 2}
    one = sim.simulate(world(sim, nodes=1, zones=1, peers=False, cpus=1, **cpu))
    four = sim.simulate(world(sim, nodes=1, zones=1, peers=False, cpus=4, **cpu))
    unbound = sim.simulate(world(sim, nodes=1, zones=1, peers=False, cpus=4, gil=0, **cpu))
    assert four["seconds"] == pytest.approx(one["seconds"])  # 4 cores, one used
    assert unbound["seconds"] < 0.5 * one["seconds"]  # without the bound its 8 streams use all 4
    # One machine, 2 cores, 2 other runnable threads: 2 agents with work get half a core each ...
    machine = sim.Machine(None, 2.0, 2.0, gil=1.0, idle=0.0)
    assert machine.share(2) == pytest.approx(0.5) and machine.share(6) == pytest.approx(0.25)
    # ... less what each uses whatever it does.
    assert sim.Machine(None, 2.0, 2.0, gil=1.0, idle=0.1).share(2) == pytest.approx(0.4)
    # A shared machine of 8 cores and no other load: 2 agents are bound by one core each, as a fleet.
    shared = sim.simulate(world(sim, nodes=2, zones=1, cpus=8, cpu_shared=True, **cpu))
    fleet = sim.simulate(world(sim, nodes=2, zones=1, cpus=8, **cpu))
    assert shared["seconds"] == pytest.approx(fleet["seconds"], rel=0.02)


def test_polls_cost_cpu_and_the_machine_follows_the_load_measured_during_the_run(sim: Any) -> None:
    """The agents' polls (counted as the agents' metric counts them) take CPU from their
    transfers on a shared machine; other processes arriving mid-run (bench/fleet.py's probe
    repeated during it) slow it from then on."""
    per_byte = 1 / (64 * MiB)
    cpu = {"cpus": 1, "cpu_shared": True, "cpu_pull": per_byte, "cpu_serve": per_byte / 2}
    base = sim.simulate(world(sim, nodes=4, zones=1, **cpu))
    assert base["polls_answered"] > 4 * 3  # every node polls the 3 others, more than once each
    polled = sim.simulate(world(sim, nodes=4, zones=1, cpu_poll=0.02, **cpu))
    assert polled["seconds"] > 1.1 * base["seconds"], (polled["seconds"], base["seconds"])
    # 12 other processes from 1 s on: 4 agents get a quarter of the core (from all of it).
    loaded = sim.simulate(world(sim, nodes=4, zones=1, cpu_others=((1.0, 12.0),), **cpu))
    assert loaded["seconds"] > 2.5 * base["seconds"], (loaded["seconds"], base["seconds"])
    # ... the probe's samples: its share and the agents' runnable threads give the others.
    fleet = {"cpus": 2, "cpu_share_during_p2p": [[0.0, 0.1, 3.0], [2.0, 2.0, 0.0]]}
    assert sim.others_over_time(fleet, "p2p") == ((0.0, 16.0), (2.0, 0.0))
    # Idle cores per agent are taken off the machine before any transfer.
    idle = sim.simulate(world(sim, nodes=4, zones=1, cpu_idle=0.125, **cpu))
    assert idle["seconds"] > 1.7 * base["seconds"], (idle["seconds"], base["seconds"])
