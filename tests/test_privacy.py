"""Client-side protection of uploaded prototypes: clipping, noise, withheld counts."""
import numpy as np

from fedbus.node.privacy.prototypes import protect

OFF = {"clip_norm": 0.0, "noise_sigma": 0.0, "withhold_counts": False}


def _payload():
    protos = np.array([[3.0, 4.0], [0.0, 0.0], [0.3, 0.4]], np.float32)
    return {"protos": protos, "counts": np.array([7, 0, 2], np.int64)}


def test_off_is_the_identity():
    p = _payload()
    assert protect(p, OFF, seed=1) is p


def test_clipping_bounds_each_prototype_norm_and_keeps_small_ones():
    out = protect(_payload(), {**OFF, "clip_norm": 1.0}, seed=1)
    norms = np.linalg.norm(out["protos"], axis=1)
    assert np.allclose(norms, [1.0, 0.0, 0.5])
    assert np.allclose(out["protos"][0], [0.6, 0.8])  # direction kept
    assert out["counts"].tolist() == [7, 0, 2]


def test_noise_is_seeded_spares_absent_classes_and_has_the_asked_scale():
    cfg = {**OFF, "noise_sigma": 0.5}
    a, b = protect(_payload(), cfg, seed=3), protect(_payload(), cfg, seed=3)
    assert np.array_equal(a["protos"], b["protos"])
    assert not np.array_equal(a["protos"], protect(_payload(), cfg, seed=4)["protos"])
    assert np.all(a["protos"][1] == 0)  # the client has no class 1: nothing to hide there
    big = {"protos": np.ones((2000, 64), np.float32), "counts": np.ones(2000, np.int64)}
    noise = protect(big, cfg, seed=0)["protos"] - 1.0
    assert abs(noise.std() - 0.5) < 0.01 and abs(noise.mean()) < 0.01


def test_withheld_counts_become_presence_flags():
    out = protect(_payload(), {**OFF, "withhold_counts": True}, seed=0)
    assert out["counts"].tolist() == [1, 0, 1] and out["counts"].dtype == np.int64
    assert np.array_equal(out["protos"], _payload()["protos"])
