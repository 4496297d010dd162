"""bench/suite/compare.py, on synthetic results.json files: each build's best time per point, head over base,
geometric means per section and variant, the points flagged slower with their runs' spread, and what is left out."""

import json
import math

from bench.suite import compare


def results(fc1_ms: dict, train_ms: dict, failed=()) -> dict:
    """A results.json: fc1 records {(shape, variant): ms} and GA = 4 training steps {(shape, variant): ms}."""
    records = [{"section": "fc1", "shape": s, "splits": "zipf", "variant": v, "ms": ms,
                "status": "failed" if (s, v) in failed else "ok"} for (s, v), ms in fc1_ms.items()]
    train = [{"ga": 4, "shape": s, "splits": "zipf", "variant": v, "ms": ms, "status": "ok"} for (s, v), ms in train_ms.items()]
    return {"records": records, "train": train}


def test_best_of_runs_ratios_and_geomeans():
    base = [results({("A", "m"): 1.00, ("B", "m"): 2.00, ("A", "t"): 3.0}, {("A", "m"): 10.0}),
            results({("A", "m"): 1.10, ("B", "m"): 1.90, ("A", "t"): 3.3}, {("A", "m"): 10.5})]
    head = [results({("A", "m"): 0.95, ("B", "m"): 2.10, ("A", "t"): 3.0}, {("A", "m"): 9.0}),
            results({("A", "m"): 1.00, ("B", "m"): 2.00, ("A", "t"): 3.1}, {("A", "m"): 9.5})]
    c = compare.compare([compare.points(r) for r in base], [compare.points(r) for r in head], flag_pct=1.0)
    assert math.isclose(c["ratios"][("fc1", "A", "zipf", "m")], 0.95)
    assert math.isclose(c["ratios"][("fc1", "B", "zipf", "m")], 2.00 / 1.90)
    assert math.isclose(c["ratios"][("train GA=4", "A", "zipf", "m")], 0.9)
    assert math.isclose(c["geomeans"][("fc1", "m")], math.sqrt(0.95 * 2.00 / 1.90))
    assert math.isclose(c["geomeans"][("fc1", "t")], 1.0)
    # only B is more than 1 % slower; its spreads are each build's max over min
    [(key, ratio, base_spread, head_spread)] = c["slower"]
    assert key == ("fc1", "B", "zipf", "m") and math.isclose(base_spread, 2.0 / 1.9) and math.isclose(head_spread, 1.05)
    assert c["left_out"] == 0


def test_failed_and_missing_points_left_out(tmp_path):
    base = results({("A", "m"): 1.0, ("B", "m"): 1.0}, {})
    head = results({("A", "m"): 1.5, ("B", "m"): 1.0, ("C", "m"): 1.0}, {}, failed={("A", "m")})
    paths = {}
    for name, r in (("base", base), ("head", head)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(r))
    md = tmp_path / "cmp.md"
    assert compare.main(["--base", str(paths["base"]), "--head", str(paths["head"]), "--md", str(md)]) == 0
    text = md.read_text()
    assert "1 points compared, 2 in one build only; 0 more than 1 % slower" in text
    assert "| fc1 | m | 1 | 1.000 |" in text
