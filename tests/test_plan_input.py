"""``graphrunner plan`` on malformed input (issue 34 items 5 and 8): every error names the file
and the line, says what was wrong, exits 2 with one line on stderr and no traceback; sizes above
the largest the command accepts are refused clearly (they ran ``gr.default_buckets`` into a
``MemoryError``: 10**12 would be a ladder of 62.5 billion buckets); ``plan_buckets`` with a
``max_graphs`` of any magnitude answers at once.
"""

from __future__ import annotations

import json
import re

import pytest

import graphrunner as gr
from graphrunner.buckets import MAX_LADDER_BATCH
from graphrunner.planning import padding_of
from graphrunner_tools import plan_input
from graphrunner_tools.cli import main
from graphrunner_tools.plan_input import MAX_SIZE, PlanInputError, load_sizes

# (file name, content (str, or bytes), the message after "FILE:LINE: ")
BAD = [
    ("empty.txt", "", 1, r"the file is empty"),
    ("blank.txt", "\n  \n", 1, r"the file is empty"),
    ("comments.txt", "# sizes\n\n# none\n", 3, r"holds only blank lines and comments: no batch size >= 1"),
    ("zeros.txt", "0\n0\n", 2, r"holds only 0s \(idle steps\)"),
    ("word.txt", "1\n2\nthree\n", 3, r"'three' is not an int"),
    ("float.txt", "1\n2.5\n", 2, r"'2\.5' is not an int"),
    ("negative.txt", "4\n\n# idle\n-3\n", 4, r"-3 is negative; a batch size is >= 0"),
    ("over.txt", f"1\n{MAX_SIZE + 1}\n", 2, rf"{MAX_SIZE + 1:,} is above {MAX_SIZE:,}, the largest batch size"),
    ("huge.txt", f"1\n5\n{2**60}\n", 3, rf"{2**60:,} is above {MAX_SIZE:,}"),
    ("trillion.json", "[1,\n 5,\n 1000000000000]", 3, r"\[2\] = 1,000,000,000,000 is above"),
    ("string.json", '[1,\n 2,\n "x"]', 3, r'\[2\] = "x" is not an int'),
    ("bool.json", "[1,\n true]", 2, r"\[1\] = true is not an int"),
    ("float.json", "[1,\n\n 2.0]", 3, r"\[1\] = 2\.0 is not an int"),
    ("nested.json", "[1,\n [2, 3]]", 2, r"\[1\] = \[2, 3\] is not an int"),
    ("neg.json", "[1,\n 2,\n\n -7]", 4, r"\[2\] = -7 is negative"),
    ("elist.json", "[]", 1, r"the list is empty: no batch size >= 1"),
    ("zlist.json", "[0, 0]", 1, r"the list is all 0 \(idle steps\)"),
    ("syntax.json", "[1,\n 2,\n", 3, r"not valid JSON \(Expecting value, column 1\)"),
    ("syntax2.json", '{"schedule": [1, 2]\n "x": 1}', 2, r"not valid JSON \(Expecting ',' delimiter"),
    ("eobj.json", "{}", 1, r"the JSON is an object with nothing in it; expected"),
    ("schedule.json", '{\n "schedule": 5}', 2, r"schedule is a number \(5\); expected a list of batch sizes"),
    ("sched_bad.json", '{"schedule": [1,\n 2,\n null]}', 3, r"schedule\[2\] = null is not an int"),
    ("levels.json", '{\n "levels": 3}', 2, r"'levels' must be a list of objects"),
    (
        "lt_neg.json",
        '{"levels": [\n {"concurrency": 1,\n  "schedule": [1,\n   -2]}]}',
        4,
        r"levels\[0\]\.schedule\[1\] = -2 is negative",
    ),
    (
        "lt_str.json",
        '{"levels": [{"concurrency": 1,\n "schedule": "1 2"}]}',
        2,
        r'levels\[0\]\.schedule is a string \("1 2"\); expected a list',
    ),
    ("lt_none.json", '{"levels": [{"concurrency": 1,\n "tier_replays": {}}]}', 1, r"without per-step schedules"),
    ("dims.json", '{"reqs": [1, 2],\n "draft": [1, 2.5]}', 2, r"draft\[1\] = 2\.5 is not an int"),
    ("dims_empty.json", '{"reqs": [1, 2],\n "draft": []}', 2, r"draft is empty"),
    ("dims_name.json", '{"reqs": [1],\n "bad name": [2]}', 2, r"'bad name' is not a dim name"),
    ("binary.txt", b"12\n7\n\xff\xfe\n", 3, r"not UTF-8 text \(byte 5: 0xff\)"),
]


@pytest.mark.parametrize("name,content,line,message", BAD, ids=[b[0] for b in BAD])
def test_every_bad_file_is_one_line_naming_the_file_and_the_line(tmp_path, capsys, name, content, line, message):
    f = tmp_path / name
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    with pytest.raises(PlanInputError) as err:
        load_sizes(str(f))
    assert str(err.value).startswith(f"{f}:{line}: ") and re.search(message, str(err.value)), str(err.value)
    assert main(["plan", str(f)]) == 2
    out, errtext = capsys.readouterr()
    assert out == "" and errtext.count("\n") == 1 and "Traceback" not in errtext
    assert errtext.startswith(f"graphrunner: error: {f}:{line}: ")


def test_files_that_cannot_be_read_are_named(tmp_path, capsys):
    for path, what in [(tmp_path, "is a directory"), (tmp_path / "missing.txt", "cannot read it")]:
        assert main(["plan", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"graphrunner: error: {path}: {what}") and err.count("\n") == 1


def test_level_of_a_non_loadtest_file_names_the_file(tmp_path, capsys):
    f = tmp_path / "sizes.txt"
    f.write_text("1\n2\n")
    assert main(["plan", str(f), "--level", "4"]) == 2
    assert capsys.readouterr().err.startswith(f"graphrunner: error: {f}:1: --level 4 needs a loadtest JSON")


def test_good_files_read_exactly_what_they_hold(tmp_path):
    """Control: every format, with comments, blank lines, a BOM, 0s and the largest size accepted."""
    text = tmp_path / "s.txt"
    text.write_text(f"\ufeff# served\n3\n\n0  # idle\n{MAX_SIZE}\n")
    assert load_sizes(str(text)) == [3, 0, MAX_SIZE]
    lst = tmp_path / "s.json"
    lst.write_text(json.dumps([1, 0, 7]))
    assert load_sizes(str(lst)) == [1, 0, 7]
    sched = tmp_path / "sched.json"
    sched.write_text(json.dumps({"schedule": [4, 2]}))
    assert load_sizes(str(sched)) == [4, 2]
    lt = tmp_path / "lt.json"
    lt.write_text(
        json.dumps(
            {"levels": [{"concurrency": 2, "schedule": [2, 1]}, {"concurrency": 4, "schedule": [4, 0, 3]}]}, indent=1
        )
    )
    assert load_sizes(str(lt)) == [2, 1, 4, 0, 3] and load_sizes(str(lt), level=4) == [4, 0, 3]
    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps({"reqs": [1, 2], "draft": [3]}))
    assert load_sizes(str(dims)) == {"reqs": [1, 2], "draft": [3]}


def test_the_line_numbers_follow_the_json_layout(tmp_path):
    """The reader's lines against the text itself: the line holding each entry."""
    values = [5, 6, "bad"]
    f = tmp_path / "pretty.json"
    f.write_text(json.dumps({"levels": [{"concurrency": 1, "schedule": values}]}, indent=2))
    want = next(i for i, ln in enumerate(f.read_text().splitlines(), 1) if '"bad"' in ln)
    with pytest.raises(PlanInputError, match=rf"pretty\.json:{want}: levels\[0\]\.schedule\[2\] = \"bad\""):
        load_sizes(str(f))


def test_default_buckets_refuses_a_ladder_too_long_to_build():
    with pytest.raises(ValueError, match=r"max_batch=1,000,000,000,000 is above 16,777,216.*62,500,000,000 buckets"):
        gr.default_buckets(10**12)
    with pytest.raises(ValueError, match="above"):
        gr.default_buckets(MAX_LADDER_BATCH + 1)
    # control: the largest accepted builds the ladder of the docstring's rule
    ladder = gr.default_buckets(MAX_LADDER_BATCH)
    assert ladder[:4] == [1, 2, 4, 8] and ladder[-1] == MAX_LADDER_BATCH
    assert len(ladder) == 3 + 31 + (MAX_LADDER_BATCH - 256) // 16 + 1
    assert plan_input.MAX_SIZE == MAX_LADDER_BATCH < 2**32


def test_plan_buckets_with_any_max_graphs_gives_every_distinct_size():
    """``max_graphs`` at or above the distinct sizes: every distinct size is a bucket (no padding,
    the fewest buckets doing so), answered without the dynamic program (it ran ``m`` layers:
    seconds for 5,000 sizes); the same answer as the program at ``max_graphs = m - 1`` plus the size
    it leaves out."""
    sizes = [7, 1, 3, 3, 9, 1, 2**60, 2**60 - 1]
    distinct = sorted(set(sizes))
    for k in (len(distinct), len(distinct) + 1, 2**62, 10**30):
        assert gr.plan_buckets(sizes, max_graphs=k) == distinct
    assert padding_of(sizes, distinct)["padded_rows"] == 0
    fewer = gr.plan_buckets(sizes, max_graphs=len(distinct) - 1)
    assert len(fewer) == len(distinct) - 1 and padding_of(sizes, fewer)["padded_rows"] > 0
    assert gr.plan_buckets(range(1, 5001), max_graphs=2**62) == list(range(1, 5001))
