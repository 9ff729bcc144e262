"""Device pinning logic, tested without a GPU by stating how many are visible."""
import pytest

from fedbus.launch.devices import assign, format_ids, parse_ids, split_clients


def test_auto_spreads_nodes_round_robin_over_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    places, warning = assign(5, ["auto"], gpu_count=2)
    assert warning is None
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in places] == ["0", "1", "0", "1", "0"]
    assert all(p.device == "cuda:0" for p in places)  # each node sees only its own GPU
    assert [p.label for p in places] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]


def test_no_gpu_falls_back_to_cpu_with_a_warning_only_when_cuda_was_asked(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    places, warning = assign(3, ["auto"], gpu_count=0)
    assert warning is None and {p.device for p in places} == {"cpu"}
    assert all(p.env["CUDA_VISIBLE_DEVICES"] == "" for p in places)
    places, warning = assign(2, ["cuda"], gpu_count=0)
    assert {p.device for p in places} == {"cpu"} and "no GPU is visible" in warning
    places, warning = assign(2, ["cuda:3"], gpu_count=2)
    assert {p.device for p in places} == {"cpu"} and "cuda:3" in warning


def test_explicit_devices_and_inherited_visibility(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    places, _ = assign(4, ["cuda:1", "cpu"], gpu_count=2)
    assert [p.label for p in places] == ["cuda:6", "cpu", "cuda:6", "cpu"]
    with pytest.raises(ValueError, match="not auto, cpu"):
        assign(1, ["tpu"], gpu_count=0)


def test_client_ranges():
    assert split_clients(10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_clients(2, 5) == [[0], [1]]
    # by work: the largest first onto the least loaded node
    assert split_clients(5, 2, [9, 1, 1, 5, 4]) == [[0, 1], [2, 3, 4]]  # 10 and 10
    assert split_clients(4, 2, [1, 1, 1, 1]) == [[0, 2], [1, 3]]
    assert split_clients(3, 3, [0, 0, 0]) == [[0], [1], [2]]
    assert parse_ids("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert format_ids([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    for bad in ("", "a-b", "5-2", "-1"):
        with pytest.raises(ValueError):
            parse_ids(bad)
