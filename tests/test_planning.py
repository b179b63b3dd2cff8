"""gr.plan_buckets (issue 25 item 3; issue 34 item 8: exact at any magnitude, O(K m log m)) against brute
force over every subset and against the O(K m^2) dynamic program it replaced (kept here as the reference,
in Python ints), its edge cases and errors, its progress bar, padding_of against a direct count, and the
planned buckets served by a GraphRunner."""

from __future__ import annotations

import io
import itertools
import random
import re
import time
from collections import Counter

import pytest
import torch

import graphrunner as gr
import graphrunner.planning as planning
from graphrunner.planning import padding_of, plan_buckets


def brute_force(sizes, k):
    """The least total padding over every set of at most ``k`` buckets drawn from 1..max(sizes)
    that contains max(sizes) (not only observed sizes: an independent reference), and the
    fewest buckets reaching it."""
    top = max(sizes)
    counts = Counter(s for s in sizes if s)
    best = None
    for r in range(0, k):
        for extra in itertools.combinations(range(1, top), r):
            bl = list(extra) + [top]
            pad = sum(c * (next(b for b in bl if b >= n) - n) for n, c in counts.items())
            if best is None or pad < best[0]:
                best = (pad, len(bl))
    return best


def padding(sizes, buckets):
    return sum(next(b for b in buckets if b >= n) - n for n in sizes if n)


@pytest.mark.parametrize("seed", range(40))
def test_planner_equals_brute_force_on_small_cases(seed):
    rng = random.Random(seed)
    top = rng.randint(1, 11)
    sizes = [rng.choice([rng.randint(1, top), rng.randint(1, 3)]) for _ in range(rng.randint(1, 25))]
    for k in range(1, 6):
        got = plan_buckets(sizes, max_graphs=k)
        assert got == sorted(set(got)) and len(got) <= k and got[-1] == max(sizes)
        assert set(got) <= set(sizes)  # observed sizes only
        best_pad, fewest = brute_force(sizes, k)
        assert padding(sizes, got) == best_pad
        assert len(got) == fewest


def test_brute_force_reference_is_not_trivially_satisfied():
    # negative control: the vLLM-style ladder and a plausible heuristic (the k most frequent sizes
    # plus the max) pad more than the planner on a skewed case, and the reference sees it
    sizes = [1] * 5 + [3] * 4 + [5] * 4 + [6] * 4 + [9]
    best_pad, _ = brute_force(sizes, 3)
    assert plan_buckets(sizes, 3) == [3, 6, 9]  # 1 -> 3 five times, 5 -> 6 four times
    assert padding(sizes, [3, 6, 9]) == best_pad == 14
    assert padding(sizes, [1, 3, 9]) > best_pad
    assert padding(sizes, gr.default_buckets(9)[-3:]) > best_pad


def test_edge_cases():
    assert plan_buckets([5], max_graphs=1) == [5]
    assert plan_buckets([5, 5, 5], max_graphs=4) == [5]  # one distinct size: one bucket
    assert plan_buckets([3, 1, 2, 2, 9], max_graphs=10) == [1, 2, 3, 9]  # enough graphs: no padding
    assert plan_buckets([0, 4, 0, 2], max_graphs=1) == [4]  # idle steps (0) carry no rows
    assert plan_buckets(torch.tensor([1, 8, 8]), 2) == [1, 8]
    assert plan_buckets([7, 1, 1, 1, 1], 1) == [7]  # the largest observed size is always a bucket
    got = plan_buckets([1, 1, 1, 3, 7, 8, 8], max_graphs=2)
    assert got == [1, 8] and padding([1, 1, 1, 3, 7, 8, 8], got) == 5 + 1


def test_named_dims_are_planned_per_dim():
    reqs = [1, 1, 2, 3, 3, 3, 8]
    draft = [2, 2, 2, 5, 6]
    got = plan_buckets({"reqs": reqs, "draft": draft}, max_graphs={"reqs": 2, "draft": 2})
    assert got == {"reqs": plan_buckets(reqs, 2), "draft": plan_buckets(draft, 2)}
    assert got["draft"] == [2, 6] and padding(reqs, got["reqs"]) == brute_force(reqs, 2)[0]
    # usable as GraphRunner(buckets=...) with named dims
    r = gr.GraphRunner(
        lambda x: x * 2, {"x": gr.BatchInput(trailing=(), dims=("reqs", "draft"))}, got, device="tape", progress=False
    )
    assert r.buckets == got


@pytest.mark.parametrize(
    "sizes,k,exc,match",
    [
        ([], 2, ValueError, r"observed_sizes holds no batch size >= 1"),
        ([0, 0], 2, ValueError, r"observed_sizes holds no batch size >= 1"),
        ([1, -3], 2, ValueError, r"observed_sizes\[1\] is -3"),
        ([1, 2.5], 2, TypeError, r"observed_sizes\[1\] is a float"),
        ([1, True], 2, TypeError, r"observed_sizes\[1\] is a bool"),
        ("1,2,3", 2, TypeError, r"observed_sizes must be a list of observed batch sizes"),
        (7, 2, TypeError, r"observed_sizes must be a list"),
        ([1, 2], 0, ValueError, r"max_graphs must be >= 1"),
        ([1, 2], 2.0, TypeError, r"max_graphs is a float \(2.0\); it must be an int >= 1"),
        ([1, 2], {"reqs": 2}, TypeError, r"max_graphs is a dict but observed_sizes is a list"),
        ({"reqs": [1, 2]}, 2, TypeError, r"give max_graphs per dim"),
        ({"reqs": [1, 2]}, {"draft": 2}, ValueError, r"max_graphs names dims \['draft'\]"),
        ({"reqs": [1, -1]}, {"reqs": 2}, ValueError, r"observed_sizes\['reqs'\]\[1\] is -1"),
        ({"reqs": [1]}, {"reqs": 0}, ValueError, r"max_graphs\['reqs'\] must be >= 1"),
        ({}, {}, ValueError, r"observed_sizes is an empty dict"),
    ],
)
def test_bad_input_is_an_error_naming_the_input(sizes, k, exc, match):
    with pytest.raises(exc, match=match):
        plan_buckets(sizes, max_graphs=k)


# --------------------------------------------------------------------------- exact at any size, and fast
def reference_plan(sizes, k):
    """The O(K m^2) dynamic program of graphrunner/planning.py before issue 34, in Python ints (exact at any
    magnitude): ``f[kk][j] = min over kk-1 <= i < j of f[kk-1][i] + cost(i, j)``, the smallest ``i`` on ties,
    the fewest buckets among the optimal lists. Returns ``(buckets, padding)``."""
    counts = Counter(s for s in sizes if s)
    v = sorted(counts)
    m, k = len(v), min(k, len(counts))
    C, S = [0], [0]
    for x in v:
        C.append(C[-1] + counts[x])
        S.append(S[-1] + counts[x] * x)

    def cost(i, j):  # sizes i+1..j padded to v[j-1]
        return v[j - 1] * (C[j] - C[i]) - (S[j] - S[i])

    f = [None] + [cost(0, j) for j in range(1, m + 1)]
    best, back = [f[m]], []
    for kk in range(2, k + 1):
        g, arg = [None] * (m + 1), [None] * (m + 1)
        for j in range(kk, m + 1):
            g[j], arg[j] = min((f[i] + cost(i, j), i) for i in range(kk - 1, j))
        f = g
        back.append(arg)
        best.append(f[m])
    kk = 1 + best.index(min(best))
    out, j = [v[-1]], m
    for t in range(kk, 1, -1):
        j = back[t - 2][j]
        out.append(v[j - 1])
    return sorted(out), min(best)


def subsets_brute_force(sizes, k):
    """The least padding over every set of at most ``k`` observed sizes holding the largest, and the fewest
    buckets reaching it (Python ints: any magnitude)."""
    counts = Counter(s for s in sizes if s)
    v = sorted(counts)
    best = None
    for r in range(min(k, len(v))):
        for extra in itertools.combinations(v[:-1], r):
            pad = padding(sizes, list(extra) + [v[-1]])
            if best is None or pad < best[0]:
                best = (pad, r + 1)
    return best


#: size ranges of the random cases: small, a narrow band near 2**60, 1..2**60, beyond int64, far beyond
MAGNITUDES = [(1, 40), (2**60 - 50, 2**60 + 50), (1, 2**60), (2**63 - 10**6, 2**63 + 10**6), (1, 2**100)]


def random_traffic(rng, distinct, lo, hi, most_calls=9):
    """Up to ``distinct`` distinct sizes in ``lo..hi``, each seen 1..``most_calls`` times."""
    distinct = min(distinct, hi - lo + 1)
    values = set()
    while len(values) < distinct:
        values.add(rng.randint(lo, hi))
    return [x for x in values for _ in range(rng.randint(1, most_calls))]


@pytest.mark.parametrize("seed", range(60))
def test_planner_equals_brute_force_over_observed_subsets_at_any_magnitude(seed):
    rng = random.Random(f"subsets-{seed}")
    lo, hi = MAGNITUDES[seed % len(MAGNITUDES)]
    sizes = random_traffic(rng, rng.randint(1, 9), lo, hi)
    rng.shuffle(sizes)
    for k in range(1, 11):
        got = plan_buckets(sizes, max_graphs=k)
        assert got == sorted(set(got)) and len(got) <= k and got[-1] == max(sizes) and set(got) <= set(sizes)
        best_pad, fewest = subsets_brute_force(sizes, k)
        assert (padding(sizes, got), len(got)) == (best_pad, fewest), (k, sorted(Counter(sizes).items()))


@pytest.mark.parametrize("seed", range(40))
def test_planner_equals_the_quadratic_dynamic_program(seed):
    # the same list, not only the same padding: the rows and the tie-breaking are those of the O(K m^2) program
    rng = random.Random(f"reference-{seed}")
    lo, hi = MAGNITUDES[seed % len(MAGNITUDES)]
    sizes = random_traffic(rng, rng.randint(1, 70), lo, hi, most_calls=rng.choice([1, 3, 40]))
    for k in (1, 2, 3, 5, 8, 13, 40, 80):
        want, want_pad = reference_plan(sizes, k)
        got = plan_buckets(sizes, max_graphs=k)
        assert got == want, (k, seed)
        assert padding(sizes, got) == want_pad


def test_planner_equals_the_quadratic_dynamic_program_on_a_deep_recursion():
    # 300 distinct sizes, ties everywhere (equal gaps, equal counts) and a skewed part: many recursion levels
    rng = random.Random(11)
    sizes = [x for x in range(1, 151) for _ in range(2)] + random_traffic(rng, 150, 200, 10**6)
    for k in (2, 7, 16):
        assert plan_buckets(sizes, max_graphs=k) == reference_plan(sizes, k)[0]


def test_sizes_near_2_60_are_exact_where_int64_overflowed():
    # issue 34 item 8: with int64 costs this returned [2**60 - 29] alone (padding 16 * (2**60 - 90), clamped)
    sizes = [61] * 16 + [2**60 - 29] * 8
    assert plan_buckets(sizes, max_graphs=2) == [61, 2**60 - 29]
    assert padding(sizes, [61, 2**60 - 29]) == 0
    # the example of the reproduction: the least padding is ~2.0e18, computed exactly
    counts = {13: 9, 28: 6, 649873830028210459: 4, 1152921504606846905: 8, 1152921504606846943: 7}
    sizes = [x for x, c in counts.items() for _ in range(c)]
    got = plan_buckets(sizes, max_graphs=2)
    assert got == [28, 1152921504606846943] == reference_plan(sizes, 2)[0]
    assert padding(sizes, got) == 2012190698314546375 == subsets_brute_force(sizes, 2)[0]


def test_the_int64_path_holds_up_to_its_bound_and_python_ints_take_over_above():
    # calls * (largest - smallest size) bounds every value the program forms: int64 below 2**63, Python ints at it
    span = 2**60
    below = [5] * 3 + [5 + span // 3] * 2 + [5 + span] * 2  # 7 calls: 7 * span < 2**63
    at = below + [5]  # 8 calls: 8 * span == 2**63
    for sizes, dtype in ((below, "int64"), (at, "object")):
        counts = Counter(sizes)
        tables = planning._tables(sorted(counts), [counts[x] for x in sorted(counts)])
        assert str(tables[0].dtype) == dtype
        for k in (1, 2, 3):
            assert plan_buckets(sizes, max_graphs=k) == reference_plan(sizes, k)[0]


def test_each_layer_evaluates_m_log_m_candidates(monkeypatch):
    # the divide and conquer, not the quadratic program: count the candidates every layer evaluates
    seen = []
    real = planning._segment_argmin

    def counting(val, i, starts, lengths):
        seen.append(len(val))
        return real(val, i, starts, lengths)

    monkeypatch.setattr(planning, "_segment_argmin", counting)
    m = 4000
    sizes = random_traffic(random.Random(3), m, 1, 10**7)
    plan_buckets(sizes, max_graphs=9)
    per_layer = sum(seen) / 8
    assert per_layer <= 2 * m * (m.bit_length() + 1)  # m log m, not m^2 / 2 (8,000,000 here)
    assert per_layer < m * m / 50


@pytest.mark.slow
def test_100000_distinct_sizes_with_64_graphs_plan_in_seconds():
    rng = random.Random(0)
    sizes = [x for x in rng.sample(range(1, 10**6), 100_000) for _ in range(rng.randint(1, 3))]
    t0 = time.process_time()
    got = plan_buckets(sizes, max_graphs=64, progress=False)
    seconds = time.process_time() - t0
    assert len(got) == 64 and got[-1] == max(sizes)
    assert seconds < 5.0, f"{seconds:.1f} s of CPU for 100,000 distinct sizes (the quadratic program: minutes)"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(
    "progress,stream,after,drawn",
    [
        (True, "terminal", 0.0, True),  # a terminal, past the delay: the bar
        (True, "terminal", 60.0, False),  # a short planning: nothing
        (True, "pipe", 0.0, False),  # not a terminal: nothing, even past the delay
        (False, "terminal", 0.0, False),  # progress=False: nothing
    ],
)
def test_progress_bar_only_on_a_terminal_past_the_delay(monkeypatch, progress, stream, after, drawn):
    out = _Terminal() if stream == "terminal" else io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.setattr(planning, "_PROGRESS_AFTER_S", after)
    sizes = random_traffic(random.Random(5), 300, 1, 10**6)
    assert plan_buckets(sizes, max_graphs=6, progress=progress) == reference_plan(sizes, 6)[0]
    text = out.getvalue()
    if not drawn:
        assert text == ""
        return
    assert text.startswith("\rgraphrunner plan_buckets (observed_sizes: 300 distinct sizes): ")
    assert text.endswith("6/6 buckets (100%) " + text.rsplit(") ", 1)[1]) and text.endswith(" done\n")


def test_task_progress_draws_in_place_then_ends_the_line():
    from graphrunner.progress import TaskProgress

    out = _Terminal()
    bar = TaskProgress(4, "work", unit="parts", stream=out, after=0.0, every=0.0)
    bar.update(1)
    bar.update(3)
    bar.close()
    bar.close()  # once
    lines = out.getvalue().split("\r")[1:]
    assert [x.split(" ")[1] for x in lines] == ["1/4", "3/4", "4/4"] and lines[-1].endswith("s done\n")
    assert "(75%)" in lines[1] and out.getvalue().count("\n") == 1
    quiet = io.StringIO()
    bar = TaskProgress(4, "work", stream=quiet, after=0.0, every=0.0)
    bar.update(2)
    bar.close()
    assert quiet.getvalue() == "" and not bar.shown


def test_observed_sizes_of_every_kind_count_alike():
    import numpy as np

    sizes = [3, 1, 1, 0, 8, 8, 5]
    want = plan_buckets(sizes, max_graphs=2)
    assert plan_buckets(tuple(sizes), 2) == plan_buckets(iter(sizes), 2) == plan_buckets(np.array(sizes), 2) == want
    assert plan_buckets(torch.tensor(sizes).reshape(7, 1), 2) == plan_buckets((n for n in sizes), 2) == want
    assert plan_buckets([np.int64(n) for n in sizes], 2) == want
    with pytest.raises(ValueError, match=r"observed_sizes\[3\] is -4"):  # an otherwise plain int list
        plan_buckets([1, 2, 3, -4, 5], 2)
    with pytest.raises(TypeError, match=r"observed_sizes\[0\] is a float \(1.0\)"):  # a float array: no ints
        plan_buckets(np.array([1.0, 2.5]), 2)
    with pytest.raises(TypeError, match=r"observed_sizes\[0\] is a bool \(True\)"):
        plan_buckets(torch.tensor([True, False, True]), 2)


def test_padding_of_counts_padded_rows_and_eager_calls():
    sizes = [1, 2, 3, 5, 9, 9, 12]
    got = padding_of(sizes, [2, 4, 9])
    # 1->2 (1), 2->2 (0), 3->4 (1), 5->9 (4), 9->9 (0) x2; 12 is above 9: eager
    assert got == {
        "graphs": 3,
        "calls": 7,
        "real_rows": 41,
        "padded_rows": 6,
        "padded_fraction": 6 / (2 + 2 + 4 + 9 + 9 + 9),
        "eager_calls": 1,
    }
    with pytest.raises(ValueError, match="buckets must be sorted"):
        padding_of(sizes, [4, 2])


def test_planner_beats_or_ties_vllms_ladder_at_equal_graph_counts():
    rng = random.Random(7)
    sizes = [max(1, min(256, int(rng.lognormvariate(3.0, 1.0)))) for _ in range(3000)]
    ladder = gr.default_buckets(max(sizes))
    planned = plan_buckets(sizes, max_graphs=len(ladder))
    assert len(planned) <= len(ladder)
    assert padding(sizes, planned) <= padding(sizes, ladder)
    assert padding(sizes, planned) < padding(sizes, ladder)  # strictly, on this skewed traffic


def test_planned_buckets_serve_calls_equal_to_eager():
    sizes = [1, 1, 2, 5, 5, 6, 11]
    buckets = plan_buckets(sizes, max_graphs=3)
    assert buckets == [1, 6, 11] or padding(sizes, buckets) == brute_force(sizes, 3)[0]

    def step(x):
        return torch.tanh(x * 3 + 1)

    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(4,))}, buckets, backend="full", device="tape", progress=False
    )
    r.capture()
    for n in sizes:
        x = torch.randn(n, 4)
        torch.testing.assert_close(r(x=x), step(x), rtol=0, atol=0)
    assert r.stats.padding_rows == padding(sizes, buckets) * 1 and r.stats.fallbacks == 0
    r.cleanup()


def test_plan_buckets_is_public_with_a_contract():
    assert gr.plan_buckets is plan_buckets and "plan_buckets" in gr.__all__
    assert "exact dynamic program" in " ".join(plan_buckets.__doc__.split())


# --------------------------------------------------------------------------- graphrunner plan
def test_cli_plan_reads_text_json_and_loadtest_files(tmp_path, capsys):
    import json

    from graphrunner_tools.cli import main

    sizes = [1, 1, 1, 3, 7, 8, 8]
    text = tmp_path / "sizes.txt"
    text.write_text("# served batch sizes\n" + "\n".join(map(str, sizes)) + "\n\n")
    assert main(["plan", str(text), "--max-graphs", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["planned"] == plan_buckets(sizes, 2) == [1, 8]
    assert got["planned_padding"] == padding_of(sizes, [1, 8])
    # vLLM's ladder with the same 2 graphs (its first size and the largest), not its whole ladder [1, 2, 4, 8]
    assert got["ladder"] == [1, 8] and got["ladder_padding"] == padding_of(sizes, [1, 8])
    lst = tmp_path / "sizes.json"
    lst.write_text(json.dumps(sizes))
    assert main(["plan", str(lst)]) == 0  # default: as many graphs as vLLM's ladder (4): no padding left
    out = capsys.readouterr().out
    assert re.search(r"planned +4 +0\.00%  1,3,7,8\n", out) and re.search(r"vLLM's ladder +4 +[0-9.]+%  1,2,4,8\n", out)
    lt = tmp_path / "loadtest.json"
    lt.write_text(
        json.dumps({"levels": [{"concurrency": 4, "schedule": [4, 4, 3, 0]}, {"concurrency": 2, "schedule": [2, 1]}]})
    )
    assert main(["plan", str(lt), "--max-graphs", "1", "--level", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["planned_padding"]["calls"] == 3  # the idle step (0) left out
    assert main(["plan", str(lt), "--max-graphs", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["planned"] == plan_buckets([4, 4, 3, 2, 1], 2)
    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps({"reqs": [1, 2, 3, 8], "draft": [2, 2, 6]}))
    assert main(["plan", str(dims), "--max-graphs", "reqs=2,draft=1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("draft: 1 buckets 6;")


def test_cli_plan_compares_with_the_ladder_at_the_same_number_of_graphs(tmp_path, capsys):
    """--max-graphs 4 on sizes up to 37: vLLM's ladder with 4 graphs is 1,2,4,37 (not its 8 graphs up to 37),
    and the printed padding is that ladder's; more graphs than the ladder has: the whole ladder, said so."""
    from graphrunner_tools.cli import main
    from graphrunner_tools.plan import ladder_with

    sizes = [1, 1, 3, 5, 7, 9, 12, 17, 20, 31, 37]
    f = tmp_path / "sizes.txt"
    f.write_text("\n".join(map(str, sizes)))
    assert main(["plan", str(f), "--max-graphs", "4"]) == 0
    out = capsys.readouterr().out
    ladder = ladder_with(37, 4)
    assert ladder == [1, 2, 4, 37] and len(gr.default_buckets(37)) == 8
    lp = padding_of(sizes, ladder)["padded_fraction"]
    whole = padding_of(sizes, gr.default_buckets(37))["padded_fraction"]
    assert re.search(rf"vLLM's ladder +4 +{lp:.2%}  1,2,4,37\n", out), out
    assert f"{whole:.2%}" not in out and lp != whole  # not the whole ladder's figure
    pp = padding_of(sizes, plan_buckets(sizes, 4))["padded_fraction"]
    assert re.search(rf"planned +4 +{pp:.2%}  ", out) and f"planned padded rows: {pp / lp:.2f}x the ladder's" in out
    assert main(["plan", str(f), "--max-graphs", "20"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"vLLM's ladder +8 +[0-9.]+%  1,2,4,8,16,24,32,37\n  \(vLLM's ladder up to 37 has only 8 sizes\)", out
    ), out
    assert ladder_with(37, 1) == [37] and ladder_with(8, 9) == gr.default_buckets(8)


@pytest.mark.parametrize(
    "content,args,message",
    [
        ("1\nx\n", [], r"sizes\.txt:2: 'x' is not an int"),
        ("[1, -2]", [], r"sizes\.txt:1: \[1\] = -2 is negative"),
        ("[]", [], r"sizes\.txt:1: the list is empty: no batch size >= 1"),
        ('{"levels": [{"concurrency": 4, "tier_replays": {"4": 9}}]}', [], r"without per-step schedules"),
        ('{"levels": [{"concurrency": 4, "schedule": [1]}]}', ["--level", "8"], r"no level of concurrency 8"),
        ("[1, 2]", ["--level", "8"], r"sizes\.txt:1: --level 8 needs a loadtest JSON"),
        ('{"reqs": [1, 2]}', [], r"names dims \['reqs'\]: pass --max-graphs reqs=K"),
        ("[1, 2]", ["--max-graphs", "reqs=2"], r"--max-graphs names dims"),
        ("[1, 2]", ["--max-graphs", "0"], r"max_graphs must be >= 1"),
        ('"text"', [], r"sizes\.txt:1: '\"text\"' is not an int"),
    ],
)
def test_cli_plan_bad_input_is_one_line_exit_2(tmp_path, capsys, content, args, message):
    from graphrunner_tools.cli import main

    f = tmp_path / "sizes.txt"
    f.write_text(content)
    assert main(["plan", str(f), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphrunner: error: ")
    import re

    assert re.search(message, err), err


def test_cli_plan_names_a_directory_and_a_missing_file(tmp_path, capsys):
    from graphrunner_tools.cli import main

    assert main(["plan", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nope.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["plan", "x", "--max-graphs", "two"]) == 2  # argparse: one line too
    assert capsys.readouterr().err.startswith("graphrunner: error: argument --max-graphs")
