"""CPUs for the connector's threads beside a CPU engine's OpenMP team (pure parsing, and
one real thread moved)."""
import os
import threading

import pytest

from kvpool.connector.vllm.affinity import Topology, format_cpus, host_topology, io_cpus, omp_cpus, parse_cpus, pin_thread


@pytest.mark.parametrize("text,cpus", [
    ("0", {0}), ("0,2-4 7", {0, 2, 3, 4, 7}), ("{0,1,2}", {0, 1, 2}), ("{0},{1}", {0, 1}),
    ("{0:4}", {0, 1, 2, 3}), ("{0:3:2},{8}", {0, 2, 4, 8}), ("cores", None), ("{0:4},!{2}", None), ("", None),
])
def test_cpu_lists_in_openmp_syntax(text, cpus):
    assert parse_cpus(text) == cpus


def test_cpu_sets_print_as_ranges():
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and format_cpus(set()) == ""
    assert parse_cpus(format_cpus({0, 1, 2, 5, 7, 8})) == {0, 1, 2, 5, 7, 8}


def test_the_team_binding_comes_from_what_vllm_sets_for_each_openmp_runtime():
    # vllm/utils/ompmultiprocessing.py: plain OpenMP, preloaded libgomp, preloaded Intel OpenMP
    assert omp_cpus({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}) == {0, 1, 2}
    assert omp_cpus({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "false"}) is None
    assert omp_cpus({"GOMP_CPU_AFFINITY": "4 5 6"}) == {4, 5, 6}
    assert omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[8,9]"}) == {8, 9}
    assert omp_cpus({"KMP_AFFINITY": "disabled,proclist=[8,9]"}) is None
    assert omp_cpus({"OMP_NUM_THREADS": "4"}) is None


def test_connector_threads_take_the_cpus_outside_the_team():
    flat = Topology(frozenset(range(8)))
    bound = {"OMP_PLACES": "{0,1,2,3,4,5}", "OMP_PROC_BIND": "true"}
    assert io_cpus(bound, flat) == {6, 7}  # the ones vLLM reserved
    every = {"OMP_PLACES": "{0,1,2,3,4,5,6,7}", "OMP_PROC_BIND": "true"}
    assert io_cpus(every, flat) == set(range(8))  # not confined to the creator's one CPU
    assert io_cpus({}, flat) is None  # no binding: threads keep what they inherit


def test_they_stay_on_the_teams_numa_node_inside_the_engines_mask_off_busy_siblings():
    # two NUMA nodes of 4 cores, hyperthreads n and n+8; rank 0's team on cores 0-2 of node 0
    nodes = (frozenset({0, 1, 2, 3, 8, 9, 10, 11}), frozenset({4, 5, 6, 7, 12, 13, 14, 15}))
    siblings = {c: frozenset({c % 8, c % 8 + 8}) for c in range(16)}
    topo = Topology(frozenset(range(16)), nodes, siblings)
    gomp = {"GOMP_CPU_AFFINITY": "0 1 2"}
    assert io_cpus(gomp, topo) == {3, 11}  # node 0, not the team cores' siblings 8-10
    ranks = dict(gomp, VLLM_CPU_OMP_THREADS_BIND="0-2|3")  # a second local rank owns core 3
    assert io_cpus(ranks, topo) == {0, 1, 2}  # nothing free on the node: the team's own CPUs
    narrow = Topology(frozenset({0, 1, 2, 3}), nodes, siblings)  # the engine runs under taskset 0-3
    assert io_cpus(gomp, narrow) == {3}
    assert io_cpus({"GOMP_CPU_AFFINITY": "20"}, narrow) is None  # nothing allowed: leave the mask


def test_this_host_reads_as_a_topology():
    topo = host_topology()
    assert topo is not None and topo.allowed and all(c in topo.siblings.get(c, {c}) for c in topo.allowed)


def test_a_pinned_thread_runs_on_the_cpus_it_was_given():
    mine = os.sched_getaffinity(0)
    target = {min(mine)}
    seen = []

    def run():
        pin_thread(target)
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == [target] and os.sched_getaffinity(0) == mine  # only the calling thread moved
    t = threading.Thread(target=lambda: (pin_thread({10_000}), seen.append(os.sched_getaffinity(0))))
    t.start()
    t.join(10)
    assert seen[-1] == mine  # a CPU set the machine lacks leaves the inherited mask
