"""Semantic segmentation end to end: the shapes-seg generator and the VOC 2012 loader
(fedbus.node.data.segmentation), the dense partition labels, the small DeepLab-V3+
(fedbus.models.segnet), dense prototypes (fedbus.algorithms.core.protos: labels downsampled by
nearest neighbour, as Michieli & Ozay's S3.2), pixel accuracy and mIoU (head_metrics), the
dense count bound of update validation, and real federations (broker, server, two nodes)
of FedAvg, which must learn, and proto-attention, plus the mask plot."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import merged, run_federation
from scipy import ndimage

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ClientContext, LocalRun, ServerContext
from fedbus.algorithms.core.metrics import confusion_matrix, dense_scores, head_metrics
from fedbus.algorithms.core.protos import (
    class_counts,
    class_means,
    class_sums,
    downsample_labels,
    labelled_embeddings,
    local_prototypes,
    nearest_prototype,
    pixel_samples,
    prototype_metrics,
)
from fedbus.algorithms.core.split import body_names, head_names
from fedbus.broker.wire import decode_body, encode_body
from fedbus.models import build_client_model, build_model, feature_dim_for
from fedbus.node.data import DatasetUnavailable, FederatedData, load_dataset
from fedbus.node.data.segmentation import SHAPES, dominant_class, generate_shapes
from fedbus.node.validate import Rejected, check_update

torch.set_num_threads(1)


# --- shapes-seg ---------------------------------------------------------------------------

def test_shapes_are_deterministic_and_sane():
    x, m = generate_shapes(120, 48, seed=3)
    x2, m2 = generate_shapes(120, 48, seed=3)
    assert np.array_equal(x, x2) and np.array_equal(m, m2)
    _, m3 = generate_shapes(120, 48, seed=4)
    assert not np.array_equal(m, m3)
    assert x.shape == (120, 3, 48, 48) and x.dtype == np.float32
    assert m.shape == (120, 48, 48) and m.dtype == np.uint8
    assert 0.0 <= x.min() and x.max() <= 1.0
    # every class occurs; every image shows at least one object; background dominates
    assert set(np.unique(m)) == set(range(len(SHAPES)))
    assert (m.reshape(120, -1) > 0).any(axis=1).all()
    assert 0.55 < (m == 0).mean() < 0.95
    # the objects carry textures: pixel values vary far more inside objects than on the
    # smooth backgrounds
    gray = x.mean(axis=1)
    inside = [gray[i][m[i] > 0].std() for i in range(120)]
    outside = [gray[i][m[i] == 0].std() for i in range(120)]
    assert np.median(inside) > 2 * np.median(outside)
    # masks match shapes: whole, unclipped single objects measured against their bounding
    # box (disc pi/4 = 0.785; a ring has a hole at its centre; a cross leaves its corners)
    ratios: dict[int, list[float]] = {c: [] for c in range(1, len(SHAPES))}
    holes = []
    for i in range(120):
        for c in np.unique(m[i])[1:]:
            lab, k = ndimage.label(m[i] == c)
            if k != 1:
                continue
            rows, cols = np.nonzero(lab)
            if rows.min() == 0 or cols.min() == 0 or rows.max() == 47 or cols.max() == 47:
                continue
            box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
            ratios[int(c)].append(len(rows) / box)
            if c == 4:
                holes.append(m[i][(rows.min() + rows.max()) // 2,
                                  (cols.min() + cols.max()) // 2] != 4)
    assert 0.7 < np.median(ratios[1]) < 0.85  # disc
    assert np.median(ratios[4]) < np.median(ratios[1]) - 0.15  # ring
    assert holes and np.mean(holes) > 0.8
    assert np.median(ratios[5]) < 0.65  # cross
    # the per-image label is the dominant object class, by hand for a few images
    y = dominant_class(m, len(SHAPES))
    for i in range(10):
        counts = np.bincount(m[i].ravel(), minlength=len(SHAPES))[1:]
        assert y[i] == counts.argmax() + 1


def test_shapes_dataset_and_client_masks():
    ds = load_dataset("shapes-seg", seed=1, num_images=80, image_size=32)
    assert ds.x.shape == (80, 3, 32, 32) and ds.masks.shape == (80, 32, 32)
    assert ds.num_classes == 6 and ds.meta["ignore_index"] == 255
    assert abs(float(ds.x.mean())) < 1e-3  # standardised per channel
    assert np.array_equal(ds.y, dominant_class(ds.masks, 6)) and ds.y.min() >= 1
    fd = FederatedData({"dataset": "shapes-seg", "partition": "iid", "domain_samples": 80,
                        "image_size": 32}, num_clients=2, seed=1)
    assert fd.label_shape == (32, 32) and fd.label_pixels == 1024
    d = fd.client(1)
    assert d.train_y.dtype == np.int64 and d.train_y.shape == (len(d.train_x), 32, 32)
    assert np.array_equal(d.train_y, fd.dataset.masks[fd.parts[1].train])
    # classification keeps one label per sample
    assert FederatedData({"dataset": "digits", "partition": "iid"}, 2, 0).label_pixels == 1


def _object_pixel_shares(fd: FederatedData) -> np.ndarray:
    """[clients, 5]: each client's share of object pixels per object class."""
    rows = []
    for i in range(fd.num_clients):
        y = fd.client(i).train_y
        counts = np.bincount(y[y > 0].ravel(), minlength=6)[1:].astype(float)
        rows.append(counts / counts.sum())
    return np.array(rows)


def test_dirichlet_partition_is_non_iid_by_class_presence():
    base = {"dataset": "shapes-seg", "domain_samples": 400, "image_size": 16}
    skew = FederatedData({**base, "partition": "dirichlet", "alpha": 0.1}, 5, seed=0)
    even = FederatedData({**base, "partition": "iid"}, 5, seed=0)
    overall = np.bincount(skew.dataset.masks[skew.dataset.masks > 0], minlength=6)[1:]
    overall = overall / overall.sum()
    # total variation between each client's object-pixel mix and the whole set's
    tv_skew = 0.5 * np.abs(_object_pixel_shares(skew) - overall).sum(axis=1)
    tv_even = 0.5 * np.abs(_object_pixel_shares(even) - overall).sum(axis=1)
    assert tv_even.max() < 0.15
    assert tv_skew.mean() > 0.35 and tv_skew.mean() > 3 * tv_even.mean()
    # ...while every client still has background and several object classes present
    for i in range(5):
        present = np.unique(skew.client(i).train_y)
        assert 0 in present and len(present) >= 3


# --- Pascal VOC 2012 ------------------------------------------------------------------------

def test_voc_absent_names_the_expected_folder(tmp_path):
    with pytest.raises(DatasetUnavailable, match="VOCdevkit/VOC2012") as err:
        load_dataset("voc2012", data_dir=str(tmp_path))
    assert "JPEGImages" in str(err.value) and "shapes-seg" in str(err.value)


def test_voc_loader_reads_a_devkit_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    root = tmp_path / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / sub).mkdir(parents=True)
    rng = np.random.default_rng(0)
    palette = [v for i in range(256) for v in (i, i, i)]
    truth = {}
    for key, cls in (("2007_000001", 15), ("2007_000002", 7), ("2008_000003", 12)):
        mask = np.zeros((40, 60), np.uint8)
        mask[10:30, 20:50] = cls  # the object
        mask[10:30, 18:24] = 255  # a void border band
        mask[0:4, 0:4] = 3  # a small second object
        truth[key] = (mask, cls)
        png = Image.fromarray(mask, mode="P")
        png.putpalette(palette)
        png.save(root / "SegmentationClass" / f"{key}.png")
        Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(
            root / "JPEGImages" / f"{key}.jpg")
    (root / "ImageSets/Segmentation/train.txt").write_text("2007_000001\n2007_000002\n")
    (root / "ImageSets/Segmentation/val.txt").write_text("2008_000003\n")
    ds = load_dataset("voc2012", data_dir=str(tmp_path), image_size=20)
    assert ds.x.shape == (3, 3, 20, 20) and ds.num_classes == 21
    assert ds.masks.shape == (3, 20, 20) and ds.meta["ignore_index"] == 255
    assert ds.y.tolist() == [15, 7, 12]  # dominant object class, not the small class 3
    # masks resized by nearest neighbour: only values of the original mask appear
    mask, cls = truth["2007_000001"]
    assert set(np.unique(ds.masks[0])) <= set(np.unique(mask))
    assert 255 in ds.masks[0] and cls in ds.masks[0]
    # a client sees the void pixels as -100, torch's cross-entropy ignore_index
    fd = FederatedData({"dataset": "voc2012", "data_dir": str(tmp_path), "image_size": 20,
                        "partition": "iid", "test_fraction": 0.0}, 1, seed=0)
    y = fd.client(0).train_y
    assert (y == -100).any() and not (y == 255).any()
    assert set(np.unique(y)) <= {-100, 0, 3, 7, 12, 15}
    small = load_dataset("voc2012", data_dir=str(tmp_path), image_size=20, num_images=2)
    assert len(small) == 2


# --- the network --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["deeplab", "deeplab:mobilenetv2"])
def test_deeplab_shapes_and_split(arch):
    net = build_model(arch, in_shape=(3, 32, 32), num_classes=6, seed=0)
    assert net.feature_dim == 64 and net.head_module == "classifier"
    x = torch.randn(2, 3, 32, 32)
    net.eval()
    h = net.features(x)
    assert h.shape == (2, 64, 8, 8)
    logits = net.head(h)
    assert logits.shape == (2, 6, 32, 32)
    assert torch.allclose(net(x), logits)
    heads = head_names(net)
    assert heads == ["classifier.weight", "classifier.bias"]
    assert set(body_names(net)) == set(net.state_dict()) - set(heads)
    same = build_model(arch, in_shape=(3, 32, 32), num_classes=6, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                                 same.state_dict().values()))
    wider = build_model(arch, in_shape=(3, 32, 32), num_classes=6, feature_dim=24, seed=0)
    assert wider.features(x).shape == (2, 24, 8, 8)


def test_deeplab_model_group_and_bad_backbone():
    group = {"group": ["deeplab:resnet8", "deeplab:mobilenetv2"]}
    assert feature_dim_for(group) == 64
    nets = [build_client_model(group, i, in_shape=(3, 32, 32), num_classes=4, seed=0)
            for i in range(2)]
    assert [n.arch for n in nets] == ["deeplab:resnet8", "deeplab:mobilenetv2"]
    # a last minibatch of one image still trains (BatchNorm sees a 2x2 map at H/16)
    assert all(n.features(torch.zeros(1, 3, 32, 32)).shape == (1, 64, 8, 8) for n in nets)
    with pytest.raises(ValueError, match="backbone"):
        build_model("deeplab:vgg", in_shape=(3, 32, 32), num_classes=4)
    with pytest.raises(ValueError, match="at least 17x17"):
        build_model("deeplab", in_shape=(3, 16, 16), num_classes=4)
    tiny = build_model("deeplab:mobilenetv2", in_shape=(1, 17, 17), num_classes=4, seed=0)
    tiny.train()
    assert tiny(torch.zeros(1, 1, 17, 17)).shape == (1, 4, 17, 17)


# --- dense prototypes by hand ---------------------------------------------------------------

def hand_map():
    """Features [1, 2, 4, 4] with h[0, :, i, j] = (i, j), and labels [1, 8, 8]: class 1 in
    the right half (columns 4..7), class 0 in the left half, except L[0, 0] = -100
    (ignored), L[1, 1] = 2 (an odd position: nearest-neighbour downsampling never reads
    it) and L[4, 6] = 2.

    Downsampled 4x4 labels d[i, j] = L[2i, 2j]: columns j = 0, 1 are class 0, j = 2, 3
    class 1, except d[0, 0] = ignored and d[2, 3] = L[4, 6] = 2. So
      class 0: (0,1) (1,0) (1,1) (2,0) (2,1) (3,0) (3,1): 7 pixels, sums (12, 4);
      class 1: (0,2) (0,3) (1,2) (1,3) (2,2) (3,2) (3,3): 7 pixels, sums (10, 17);
      class 2: (2,3): 1 pixel, sum (2, 3).
    """
    i, j = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    h = torch.stack([i, j])[None]
    labels = torch.zeros(1, 8, 8, dtype=torch.int64)
    labels[:, :, 4:] = 1
    labels[0, 0, 0] = -100
    labels[0, 1, 1] = 2
    labels[0, 4, 6] = 2
    return h, labels


class MapNet(torch.nn.Module):
    """features(x) = x: a 'network' whose dense features are its input."""

    def features(self, x):
        return x


def test_dense_prototypes_match_the_hand_computation():
    h, labels = hand_map()
    down = downsample_labels(labels, (4, 4))
    assert down[0, 0].tolist() == [-100, 0, 1, 1]
    assert down[0, 2].tolist() == [0, 0, 1, 2]
    f, y = pixel_samples(h, labels, 3)
    assert f.shape == (15, 2) and y.shape == (15,)  # 16 pixels, one ignored
    sums, counts = class_sums(h, labels, 3)
    assert counts.tolist() == [7, 7, 1]
    assert sums.tolist() == [[12.0, 4.0], [10.0, 17.0], [2.0, 3.0]]
    means, _ = class_means(h, labels, 3)
    assert torch.allclose(means, torch.tensor([[12 / 7, 4 / 7], [10 / 7, 17 / 7], [2, 3]]))
    protos, n = local_prototypes(MapNet(), h, labels, 3)
    assert n.tolist() == [7, 7, 1] and np.allclose(protos, means.numpy())
    f2, y2 = labelled_embeddings(MapNet(), h, labels)
    assert torch.equal(f2, f) and torch.equal(y2, y)
    assert f[y == 2].tolist() == [[2.0, 3.0]]
    # counts per class at label resolution (64 pixels, one ignored) and feature resolution
    assert class_counts(labels, 3).tolist() == [30, 31, 2]
    assert class_counts(labels, 3, size=(4, 4)).tolist() == [7, 7, 1]
    # classification inputs pass through untouched
    flat, yy = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    assert pixel_samples(flat, yy)[0] is flat


def test_dense_prototype_inference_and_scores_by_hand():
    h, labels = hand_map()
    # prototypes (0, 0) and (0, 3); class 2's is not allowed. Feature pixel (i, j) is
    # closer to (0, 3) iff (j - 3)^2 < j^2, i.e. j >= 2: columns 0, 1 -> 0, 2, 3 -> 1.
    protos = torch.tensor([[0.0, 0.0], [0.0, 3.0], [3.5, 3.5]])
    allowed = torch.tensor([True, True, False])
    pred = nearest_prototype(h, protos, allowed)
    assert pred.shape == (1, 4, 4)
    assert pred[0].tolist() == [[0, 0, 1, 1]] * 4
    # Upsampled to 8x8: class 0 in columns 0..3, class 1 in 4..7. Against L (63 valid
    # pixels) it misses only the two class-2 pixels: pixel accuracy 61/63.
    # IoU_0 = 30 / 31 (truth 0: 30 pixels, all found; (1,1) is predicted 0 too),
    # IoU_1 = 31 / 32 ((4,6) predicted 1), IoU_2 = 0 / 2.
    out = prototype_metrics(MapNet(), h, labels, protos, allowed)
    assert out["proto_acc"] == pytest.approx(61 / 63)
    assert out["proto_miou"] == pytest.approx((30 / 31 + 31 / 32 + 0.0) / 3)
    # Class 2 allowed, at (3.5, 3.5): squared distances to (0, 0), (0, 3), (3.5, 3.5) make
    # (2,2) 8/5/4.5, (2,3) 13/4/2.5, (3,1) 10/13/6.5, (3,2) 13/10/2.5, (3,3) 18/9/0.5
    # class 2 (every other pixel keeps its class above, e.g. (2,1) 5/8/8.5, (3,0)
    # 9/18/12.5, (1,3) 10/1/6.5). In label pixels, 2x2 blocks each: the class-2 blocks
    # hold 4 truth-0 ((3,1)), 15 truth-1 and 1 truth-2 ((4,6)) pixels; class 0 keeps 26
    # right (+ (1,1) wrong), class 1 16 right. Accuracy (26 + 16 + 1) / 63.
    # IoU_0 = 26 / (30 + 27 - 26), IoU_1 = 16 / (31 + 16 - 16), IoU_2 = 1 / (2 + 20 - 1).
    pred = nearest_prototype(h, protos)
    assert pred[0].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 2, 2], [0, 2, 2, 2]]
    out = prototype_metrics(MapNet(), h, labels, protos)
    assert out["proto_acc"] == pytest.approx(43 / 63)
    assert out["proto_miou"] == pytest.approx((26 / 31 + 16 / 31 + 1 / 21) / 3)


class FixedLogits(torch.nn.Module):
    def forward(self, x):
        return x


def test_pixel_accuracy_and_miou_by_hand():
    # one 2x3 image, 4 classes; truth [[0, 0, 1], [1, 2, ignore]], prediction
    # [[0, 1, 1], [1, 1, 0]] (logits 2 on the predicted class, 0 elsewhere).
    truth = torch.tensor([[[0, 0, 1], [1, 2, -100]]])
    pred = torch.tensor([[[0, 1, 1], [1, 1, 0]]])
    logits = 2.0 * torch.nn.functional.one_hot(pred, 4).permute(0, 3, 1, 2).float()
    out = head_metrics(FixedLogits(), logits, truth)
    # 5 valid pixels, 3 right: (0,0), (0,2), (1,0)
    assert out["acc"] == pytest.approx(3 / 5)
    # IoU_0 = 1 / (1 + 1 FN) = 1/2; IoU_1 = 2 / (2 + 2 FP) = 1/2; IoU_2 = 0 / 1;
    # class 3 is in neither truth nor prediction: left out of the mean.
    assert out["miou"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    # cross-entropy per pixel: right -log(e^2 / (e^2 + 3)), wrong -log(1 / (e^2 + 3))
    z = math.exp(2) + 3
    assert out["loss"] == pytest.approx((3 * -math.log(math.exp(2) / z) + 2 * math.log(z)) / 5)
    assert out["num_test"] == 1
    conf = confusion_matrix(pred, truth, 4)
    assert conf.tolist() == [[1, 1, 0, 0], [0, 2, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert dense_scores(np.zeros((3, 3))) == (pytest.approx(float("nan"), nan_ok=True),) * 2


def test_dense_fedproto_regulariser_by_hand():
    # FedProto's "mse" regulariser on the hand map, global prototypes g0 = (0, 0),
    # g1 = (0, 3), class 2 without one (its pixel is its own target: adds 0).
    # class 0 pixels: sum of i^2 + j^2 = 1 + 1 + 2 + 4 + 5 + 9 + 10 = 32;
    # class 1 pixels: sum of i^2 + (j - 3)^2 = 1 + 0 + 2 + 1 + 5 + 10 + 9 = 28;
    # mean over 15 pixels x 2 channels: 60 / 30 = 2.
    h, labels = hand_map()
    ctx = ClientContext(client=0, model=MapNet(), device=torch.device("cpu"),
                        train_x=h, train_y=labels, test_x=h, test_y=labels, num_classes=3,
                        feature_dim=2, params={}, train={"lr": 0.1, "momentum": 0.0,
                                                         "weight_decay": 0.0,
                                                         "batch_size": 1}, seed=0)
    ctx.model.lin = torch.nn.Linear(1, 1)  # an optimiser needs a parameter
    client = get_algorithm("fedproto").client(ctx)
    assert client.train_counts.tolist() == [30, 31, 2]  # label pixels per class
    client._global = torch.tensor([[0.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    client._has = torch.tensor([True, True, False])
    assert client.proto_reg(h, labels).item() == pytest.approx(2.0)
    # eq. 8's form: ||mean_0 - g0|| + ||mean_1 - g1|| over the classes with a prototype
    client.proto_loss = "eq8"
    want = math.hypot(12 / 7, 4 / 7) + math.hypot(10 / 7, 17 / 7 - 3)
    assert client.proto_reg(h, labels).item() == pytest.approx(want, rel=1e-6)


# --- in-process training and validation -----------------------------------------------------

TRAIN = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "batch_size": 8}


def seg_clients(name, params=None, clients=2, archs=("deeplab",)):
    fd = FederatedData({"dataset": "shapes-seg", "partition": "iid", "domain_samples": 40,
                        "image_size": 32}, clients, seed=0)
    make = [lambda i, a=a: build_model(a, in_shape=fd.in_shape, num_classes=6, seed=0)
            for a in archs]
    algo = get_algorithm(name)
    server = algo.server(ServerContext(params=params or {}, train=TRAIN, num_classes=6,
                                       feature_dim=64, clients=clients, rounds=2, seed=0,
                                       homogeneous=len(archs) == 1,
                                       make_model=lambda i: make[i % len(make)](i)))
    handlers = []
    for i in range(clients):
        d = fd.client(i)
        handlers.append(algo.client(ClientContext(
            client=i, model=make[i % len(make)](i), device=torch.device("cpu"),
            train_x=torch.tensor(d.train_x), train_y=torch.tensor(d.train_y),
            test_x=torch.tensor(d.test_x), test_y=torch.tensor(d.test_y), num_classes=6,
            feature_dim=64, params=params or {}, train=TRAIN, seed=i)))
    return fd, server, handlers


@pytest.mark.parametrize("name", ["fedproto", "proto-attention", "fedavg-proto", "fedtgp"])
def test_prototype_methods_train_and_validate_on_masks(name):
    from fedbus.algorithms.core.handlers import RoundInfo

    archs = ("deeplab:resnet8", "deeplab:mobilenetv2") if name in ("fedproto", "fedtgp") \
        else ("deeplab",)
    fd, server, handlers = seg_clients(name, archs=archs)
    for r in range(2):
        info = RoundInfo(r, 2)
        for i, h in enumerate(handlers):
            before = [p.detach().clone() for p in h.ctx.model.parameters()]
            run = LocalRun(h.ctx, epochs=1, seed=r)
            # through the wire codec, as the server receives it
            raw = encode_body(h.train(server.make_task(i, info), run))
            payload = decode_body(raw, max_frame=len(raw))
            assert any(not torch.equal(a, b) for a, b in
                       zip(before, h.ctx.model.parameters()))
            body = {"task": 1, "version": r, "num_samples": len(h.ctx.train_y),
                    "work": run.work.to_dict(), "payload": payload}
            # per-class counts are pixels at feature resolution (8x8 of 32x32): within
            # samples x label pixels, far over the sample count alone
            if "counts" in payload:
                counts = payload["counts"]
                assert counts.sum() == (h.ctx.train_y.shape[0] * 64)
                with pytest.raises(Rejected, match="more than the client"):
                    check_update(body, server.update_spec(), num_classes=6,
                                 max_samples=len(h.ctx.train_y))
            check_update(body, server.update_spec(), num_classes=6,
                         max_samples=len(h.ctx.train_y), label_pixels=fd.label_pixels)
            from fedbus.algorithms.core.handlers import ClientUpdate, Work
            server.aggregate([ClientUpdate(i, payload, len(h.ctx.train_y),
                                           Work.from_dict(run.work.to_dict()), r)], [], info)
    out = handlers[0].evaluate(server.make_eval(0, RoundInfo(1, 2)))
    for key in ("acc", "miou", "loss", "proto_acc", "proto_miou"):
        assert 0.0 <= out[key] and math.isfinite(out[key]), (key, out)
    assert out["acc"] <= 1 and out["miou"] <= 1 and out["proto_miou"] <= 1
    h, y = handlers[0].embed(50)
    assert h.shape == (50, 64) and y.shape == (50,) and (y >= 0).all()
    masks = handlers[0].masks(server.make_eval(0, RoundInfo(1, 2)), 2)
    assert masks["image"].shape == (2, 32, 32, 3) and masks["pred"].shape == (2, 32, 32)
    assert masks["truth"].dtype == np.uint8 and masks["pred"].max() < 6


def test_masks_hook_scores_the_global_model_and_keeps_the_local_one():
    from fedbus.algorithms.core.handlers import RoundInfo

    _, server, handlers = seg_clients("fedavg")
    h = handlers[0]
    local = {k: v.clone() for k, v in h.ctx.model.state_dict().items()}
    with torch.no_grad():
        for p in h.ctx.model.parameters():
            p.add_(0.5)  # the client's own weights now differ from the global ones
    own = {k: v.clone() for k, v in h.ctx.model.state_dict().items()}
    task = server.make_eval(0, RoundInfo(0, 1))
    got = h.masks(task, 3)
    assert all(torch.equal(v, h.ctx.model.state_dict()[k]) for k, v in own.items())
    h.ctx.model.load_state_dict(local)  # the global weights, as the server built them
    h.ctx.model.eval()
    want = h.ctx.model(h.ctx.test_x[:3]).argmax(1).numpy()
    assert np.array_equal(got["pred"], want)
    truth = h.ctx.test_y[:3].numpy()
    assert np.array_equal(got["truth"], truth.astype(np.uint8))
    assert get_algorithm("fedavg").client(handlers[0].ctx).masks(task, 0) is None


def test_classification_clients_send_no_masks():
    from algo_support import client_ctx, iid_digits_parts

    h = get_algorithm("fedavg").client(client_ctx(0, iid_digits_parts(2)[0], {}))
    assert h.masks({}, 2) is None


# --- real federations -------------------------------------------------------------------------

SEG = {
    "federation": {"clients": 3, "rounds": 5, "seed": 0, "start_timeout_s": 60.0,
                   "eval_every": 5},
    "data": {"dataset": "shapes-seg", "partition": "dirichlet", "alpha": 1.0,
             "domain_samples": 240, "image_size": 32, "min_samples": 30},
    "model": {"arch": "deeplab"},
    "algorithm": {"name": "fedavg"},
    "train": {"epochs": 3, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "bus": {"heartbeat_s": 0.5, "liveness": 6},
    "launch": {"nodes": 2},
    "log": {"embeddings": 100},
}


def all_background_miou(fd: FederatedData) -> float:
    """Mean over clients of the test-split mIoU of predicting background everywhere:
    IoU_background = background pixels / valid pixels, 0 for every other class present
    in the truth, averaged over the classes present in truth or prediction."""
    scores = []
    for i in range(fd.num_clients):
        y = fd.client(i).test_y
        y = y[y >= 0]
        present = set(np.unique(y).tolist()) | {0}
        scores.append((y == 0).mean() / len(present))
    return float(np.mean(scores))


def test_fedavg_learns_segmentation_in_a_real_federation(tmp_path):
    run, summary = run_federation(tmp_path, SEG, timeout=400)
    final = summary["final"]
    fd = FederatedData(SEG["data"], SEG["federation"]["clients"], SEG["federation"]["seed"])
    trivial = all_background_miou(fd)
    assert 0.1 < trivial < 0.3
    assert final["miou_mean"] > trivial + 0.15, (final, trivial)
    assert final["acc_mean"] > 0.85  # pixel accuracy, background is ~80 %
    assert summary["best"]["miou_mean"] >= final["miou_mean"]
    # the mask plot's data: images, truth and prediction of the final global model
    from fedbus.analysis import plots
    body = plots.load_embeddings(run / "masks.fbk")
    rows, notes = plots.mask_rows(body)
    assert len(rows) == 6 and not notes  # 3 clients x 2 images
    cid, img, truth, pred = rows[0]
    assert img.shape == (32, 32, 3) and truth.shape == pred.shape == (32, 32)
    assert np.array_equal(truth, fd.client(int(cid)).test_y[0].astype(np.uint8))
    emb = plots.load_embeddings(run / "embeddings.fbk")
    h = np.asarray(emb["clients"]["0"]["h"])
    assert h.shape == (100, 64)
    if plots.have_matplotlib():
        report = plots.plot_runs([plots.load_run(run)], tmp_path / "plots", tsne=False)
        assert tmp_path / "plots" / "masks.png" in report.written


@pytest.mark.parametrize("name,model", [
    ("proto-attention", {"arch": "deeplab"}),
    ("fedproto", {"group": ["deeplab:resnet8", "deeplab:mobilenetv2"]}),
])
def test_prototype_methods_complete_a_segmentation_federation(tmp_path, name, model):
    cfg = merged(SEG, federation={"rounds": 2, "eval_every": 1}, algorithm={"name": name},
                 train={"epochs": 1}, data={"domain_samples": 120, "min_samples": 20},
                 log={"embeddings": 0})
    cfg["model"] = model
    run, summary = run_federation(tmp_path, cfg, timeout=300)
    assert summary["rounds_completed"] == 2 and summary["rejected"] == 0
    final = summary["final"]
    for key in ("acc_mean", "miou_mean", "proto_acc_mean", "proto_miou_mean"):
        assert 0.0 < final[key] <= 1.0, (key, final)
    import json
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"miou", "proto_miou"} <= set(recs[-1]["per_client"]["0"])  # per client too
    if name == "proto-attention":
        assert all("attention" in r["agg_extra"] for r in recs)
    else:  # every class's prototype was aggregated from pixel counts
        assert recs[-1]["agg"]["classes"] == 6
