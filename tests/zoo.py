"""A zoo of small LightningModules written the way users write them, one idiom per case.

Used by the profiling tests (tests/test_profiling_zoo.py) and by the training tests that run every
case under ``strategy="fleet"`` and compare it with plain single-process Lightning. Every module is
tiny (<= ~20k parameters), runs on CPU, is deterministic after ``seed_everything(0)``, and reads at
most 64 samples (48 train, 16 validation) in batches of 4. ``CASES[name].data()`` gives the keyword
arguments of ``trainer.fit``; ``case.trainer`` the extra Trainer arguments the idiom needs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import numpy
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torchmetrics.classification import Accuracy

SAMPLES = 64
"""Samples in every data set."""
TRAIN = 48
"""The first TRAIN samples train, the rest validate."""
BATCH_SIZE = 4
"""Loader batch size of every case."""
FEATURES, HIDDEN, CLASSES = 8, 32, 3
"""Tabular inputs, hidden width and classes of the small classifiers."""
VOCAB, SEQ = 32, 8
"""Token models: vocabulary and sequence length."""


@dataclass(frozen=True)
class Case:
    """One zoo entry: how to build its module and data, and what it exercises."""

    name: str
    module: Callable[[], LightningModule]  # called after seed_everything(0)
    data: Callable[[], dict]  # kwargs for trainer.fit: {"datamodule": dm} or {"train_dataloaders": dl, "val_dataloaders": dl}
    trainer: dict = field(default_factory=dict)  # extra Trainer kwargs, e.g. {"precision": "bf16-mixed"}
    batch_dependent: bool = False  # the loss depends on the micro-batch (BN, in-batch negatives, sum loss)
    features: tuple[str, ...] = ()  # tags: "manual_optimization", "custom_sampler", "iterable", "metrics", ...


# --- data: small random tensors from fixed generator seeds ---------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def classification_data(seed: int = 0) -> TensorDataset:
    """(features, class) pairs; the class is the argmax of a fixed linear map, so it can be learnt."""
    g = _generator(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(-1))


def regression_data(seed: int = 1) -> TensorDataset:
    """(features, target) pairs: a fixed linear map plus a little noise; targets have shape (1,)."""
    g = _generator(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def sequence_data(seed: int = 2) -> TensorDataset:
    """(sequence of SEQ feature vectors, class) pairs."""
    g = _generator(seed)
    x = torch.randn(SAMPLES, SEQ, 4, generator=g)
    return TensorDataset(x, (x.sum(dim=(1, 2)) > 0).long() + (x[:, 0, 0] > 1).long())


def token_data(seed: int = 3) -> TensorDataset:
    """(tokens, next tokens) pairs of a learnable sequence rule x[t+1] = 3 x[t] + 1 (mod VOCAB) from random starts."""
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=_generator(seed))
    steps = torch.arange(SEQ + 1)
    tokens = (start * 3 ** steps + (3 ** steps - 1) // 2) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def token_class_data(seed: int = 4) -> TensorDataset:
    """(tokens, class) pairs: the class is the sum of the tokens modulo CLASSES."""
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=_generator(seed))
    return TensorDataset(tokens, tokens.sum(-1) % CLASSES)


def image_data(seed: int = 5) -> TensorDataset:
    """(1x8x8 image, class) pairs: the class is the brightest quadrant of the upper half or 2."""
    g = _generator(seed)
    x = torch.randn(SAMPLES, 1, 8, 8, generator=g)
    quadrants = torch.stack([x[:, 0, :4, :4].mean((1, 2)), x[:, 0, :4, 4:].mean((1, 2)), x[:, 0, 4:].mean((1, 2))], -1)
    return TensorDataset(x, quadrants.argmax(-1))


def pair_data(seed: int = 6) -> TensorDataset:
    """(query, document, similarity in [-1, 1]) triples for the two-tower model."""
    g = _generator(seed)
    query, doc = torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(query, doc, F.cosine_similarity(query, doc @ torch.randn(FEATURES, FEATURES, generator=g)))


def view_data(seed: int = 7) -> TensorDataset:
    """(view a, view b) pairs: two noisy views of one sample, for contrastive learning."""
    g = _generator(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    a, b = (x + 0.1 * torch.randn(SAMPLES, FEATURES, generator=g) for _ in range(2))
    return TensorDataset(a, b)


class DictDataset(Dataset):
    """A map-style dataset whose samples are dicts {"features", "label"}."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        features, label = self.data[index]
        return {"features": features, "label": label}


class Stream(IterableDataset):
    """An IterableDataset that streams the samples of a TensorDataset in order (no length)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        for index in range(len(self.data)):
            yield self.data[index]


def split(data: Dataset) -> tuple[Subset, Subset]:
    """The first TRAIN samples and the rest."""
    return Subset(data, range(TRAIN)), Subset(data, range(TRAIN, SAMPLES))


def loaders(data: Dataset, **train_kwargs: Any) -> dict[str, DataLoader]:
    """fit() kwargs: a training loader over the first TRAIN samples, a validation loader over the rest."""
    train, val = split(data)
    return {
        "train_dataloaders": DataLoader(train, batch_size=BATCH_SIZE, **train_kwargs),
        "val_dataloaders": DataLoader(val, batch_size=BATCH_SIZE),
    }


def sampler_loaders(data: Dataset, train_sampler: Any, val_sampler: Any = None) -> dict[str, DataLoader]:
    """fit() kwargs with a training sampler over the whole dataset (it decides the split); validation by its own
    sampler, or over the last SAMPLES - TRAIN samples in order."""
    if val_sampler is None:
        val = DataLoader(split(data)[1], batch_size=BATCH_SIZE)
    else:
        val = DataLoader(data, batch_size=BATCH_SIZE, sampler=val_sampler)
    return {"train_dataloaders": DataLoader(data, batch_size=BATCH_SIZE, sampler=train_sampler), "val_dataloaders": val}


class ZooDataModule(pl.LightningDataModule):
    """A LightningDataModule over one of the data sets above (training shuffled, as users write it)."""

    def __init__(self, make: Callable[[], Dataset]) -> None:
        super().__init__()
        self.make = make

    def setup(self, stage: str) -> None:
        self.train, self.val = split(self.make())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=BATCH_SIZE, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=BATCH_SIZE)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


# --- modules ------------------------------------------------------------------------------------------


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    """Linear-ReLU-Linear."""
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class ZooModule(LightningModule):
    """What every case shares: training logs ``train_loss``, validation/test log their loss with ``sync_dist=True``,
    predict returns the predictions, SGD optimizes. A case defines :meth:`loss_and_prediction` and its idiom."""

    learning_rate = 0.1

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The mean loss of a batch and the predictions."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss, _ = self.loss_and_prediction(batch)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: Any, stage: str) -> Tensor:
        loss, _ = self.loss_and_prediction(batch)
        self.log(f"{stage}_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss_and_prediction(batch)[1]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


class Classifier(ZooModule):
    """An MLP classifier of (features, class) batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(FEATURES, HIDDEN, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits.argmax(-1)


class ItemLogging(Classifier):
    """Logs Python floats: ``self.log(..., loss.item())``."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, prediction = self.loss_and_prediction(batch)
        self.log("train_loss", loss.item(), prog_bar=True)
        self.log("train_acc", (prediction == batch[1]).float().mean().item())
        return loss


class DeviceTensors(ZooModule):
    """Positions from ``torch.arange(n, device=self.device)`` and position weights created without a device."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.pos = nn.Embedding(SEQ, 16)
        self.head = nn.Linear(16, CLASSES)

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        x, y = batch
        positions = torch.arange(x.shape[1], device=self.device)
        decay = torch.linspace(1.0, 0.5, x.shape[1])  # no device: CPU code as some users write it
        h = torch.tanh(self.inp(x) + self.pos(positions))
        logits = self.head((h * decay[:, None]).mean(1))
        return F.cross_entropy(logits, y), logits.argmax(-1)


class BoolMasks(Classifier):
    """Boolean mask indexing (read and write) and ``nonzero``."""

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        x, y = batch
        x = x.clone()
        x[x.abs() < 0.1] = 0.0  # masked write: drop tiny features
        logits = self(x)
        valid = y >= 0  # labels < 0 would be ignored
        rows = torch.nonzero(valid).squeeze(1)
        loss = F.cross_entropy(logits[valid], y[rows])
        return loss, logits.argmax(-1)


class TorchMetrics(Classifier):
    """torchmetrics Accuracy updated in training_step and validation_step."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_acc = Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, prediction = self.loss_and_prediction(batch)
        self.train_acc(prediction, batch[1])
        self.log_dict({"train_loss": loss, "train_acc": self.train_acc})
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().validation_step(batch, batch_idx)
        self.val_acc.update(self.loss_and_prediction(batch)[1], batch[1])
        self.log("val_acc", self.val_acc)
        return loss


class ManualOptimization(Classifier):
    """``automatic_optimization = False``: one optimizer, ``manual_backward``, ``opt.step()``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss, _ = self.loss_and_prediction(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)


@dataclass
class Output:
    """What DictBatch's forward returns."""

    logits: Tensor
    embedding: Tensor


class DictBatch(ZooModule):
    """Dict batches, a dataclass output from forward, and a training_step returning a dict with "loss"."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, features: Tensor) -> Output:
        embedding = self.encoder(features)
        return Output(logits=self.head(embedding), embedding=embedding)

    def loss_and_prediction(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        out = self(batch["features"])
        return F.cross_entropy(out.logits, batch["label"]), out.logits.argmax(-1)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss, prediction = self.loss_and_prediction(batch)
        self.log("train_loss", loss)
        return {"loss": loss, "prediction": prediction}


class TransformerEncoderClassifier(ZooModule):
    """``nn.TransformerEncoder`` over token embeddings, mean-pooled into a classifier (layers nested in ``encoder``)."""

    learning_rate = 3e-3

    def __init__(self, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, CLASSES)

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        tokens, y = batch
        logits = self.head(self.encoder(self.embed(tokens)).mean(1))
        return F.cross_entropy(logits, y), logits.argmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class CnnBatchNorm(ZooModule):
    """A small CNN with BatchNorm (normalises over the micro-batch in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()
        )
        self.head = nn.Linear(16, CLASSES)

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self.head(self.features(x))
        return F.cross_entropy(logits, y), logits.argmax(-1)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learnt scale (Zhang & Sennrich 2019)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding (Su et al. 2021) of (batch, heads, time, head_dim) tensors, halves rotated."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention via scaled_dot_product_attention, rotary positions; reshapes by its head counts."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = h.shape
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """The gated MLP: down(silu(gate(h)) * up(h))."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLayer(nn.Module):
    """Pre-norm decoder layer: GQA attention, SwiGLU MLP, residual adds."""

    def __init__(self, width: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.attn = LlamaAttention(width, heads, kv_heads)
        self.mlp = SwiGLU(width, ffn)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(ZooModule):
    """A Llama-style decoder: RMSNorm, rotary embeddings (non-persistent buffers), GQA, SwiGLU, untied head."""

    learning_rate = 3e-3

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 48, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.shape = (heads, kv_heads)
        self.layers = nn.ModuleList(LlamaLayer(width, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        half = width // heads // 2
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        return self.head(self.norm(x))

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits.argmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, weight_decay=0.0)

    def fleet_layers(self) -> nn.ModuleList:
        """The repeated decoder layers (lightning_fleet's optional hook)."""
        return self.layers

    def fleet_tensor_parallel(self) -> dict[str, Any]:
        """Tensor-parallel patterns (lightning_fleet's optional hook): the query, key, value, gate and up projections
        split by columns, the output and down projections by rows; the attention reshapes by its head counts
        (``view(b, t, self.heads, ...)``), which a split layer holds a tp-th of ('per_rank'); the layers' norms run on
        sequence shards under sequence parallelism ('sequence')."""
        return {"num_heads": self.shape[0], "num_kv_heads": self.shape[1], "column": [r".*\.(q|k|v|gate|up)\.weight$"],
                "row": [r".*\.(o|down)\.weight$"], "per_rank": [r".*\.heads$", r".*\.kv_heads$"],
                "sequence": [r".*_norm\.weight$"]}


class TiedEmbeddings(ZooModule):
    """A token model whose output head shares the embedding matrix."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        tokens, targets = batch
        logits = self.head(self.mix(self.embed(tokens)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits.argmax(-1)


class FrozenBackbone(Classifier):
    """A frozen feature extractor (``requires_grad=False``) under a trained head; the optimizer sees the head only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(mlp(FEATURES, HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.learning_rate)


class LrSchedulerStep(Classifier):
    """A learning-rate scheduler stepped every optimizer step (``interval: "step"``)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class KeepsLoss(Classifier):
    """Keeps its losses: a list of them and a running mean attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[Tensor] = []
        self.running_loss: Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        self.running_loss = loss.detach() if self.running_loss is None else 0.9 * self.running_loss + 0.1 * loss.detach()
        return loss


class MlpRegression(ZooModule):
    """An ``nn.Sequential`` MLP regression (layers that own their parameters directly)."""

    reduction = "mean"

    def __init__(self) -> None:
        super().__init__()
        self.learning_rate = 0.05
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        x, y = batch
        prediction = self.net(x)
        return F.mse_loss(prediction, y, reduction=self.reduction), prediction


class SumLoss(MlpRegression):
    """The loss sums over the samples (``reduction="sum"``): it grows with the micro-batch."""

    reduction = "sum"

    def __init__(self) -> None:
        super().__init__()
        self.learning_rate = 0.005


class TwoTower(ZooModule):
    """Query and document towers whose projections share (tie) one weight, inputs centred by registered buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.doc = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.query_proj = nn.Linear(HIDDEN, 16)
        self.doc_proj = nn.Linear(HIDDEN, 16)
        self.doc_proj.weight = self.query_proj.weight
        self.register_buffer("center", torch.zeros(FEATURES))
        self.register_buffer("scale", torch.tensor(2.0))

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        query, doc, target = batch
        q = self.query_proj(self.query(query - self.center))
        d = self.doc_proj(self.doc(doc - self.center))
        similarity = torch.tanh(self.scale * F.cosine_similarity(q, d))
        return F.mse_loss(similarity, target), similarity


class Contrastive(ZooModule):
    """InfoNCE with in-batch negatives: every other sample of the micro-batch is a negative."""

    temperature = 0.1

    def __init__(self) -> None:
        super().__init__()
        self.encoder = mlp(FEATURES, HIDDEN, 16)

    def loss_and_prediction(self, batch: Any) -> tuple[Tensor, Tensor]:
        a, b = (F.normalize(self.encoder(view), dim=-1) for view in batch)
        logits = a @ b.T / self.temperature
        return F.cross_entropy(logits, torch.arange(len(a), device=self.device)), logits.argmax(-1)


def _sampled() -> dict[str, DataLoader]:
    order = torch.randperm(SAMPLES, generator=_generator(10)).tolist()
    return sampler_loaders(
        classification_data(),
        SubsetRandomSampler(order[:TRAIN], generator=_generator(11)),
        SubsetRandomSampler(order[TRAIN:], generator=_generator(12)),
    )


def _weighted() -> dict[str, DataLoader]:
    weights = torch.linspace(1.0, 3.0, TRAIN).tolist() + [0.0] * (SAMPLES - TRAIN)  # validation samples never drawn
    sampler = WeightedRandomSampler(weights, num_samples=TRAIN, replacement=True, generator=_generator(13))
    return sampler_loaders(classification_data(), sampler)


def _streamed() -> dict[str, DataLoader]:
    train, val = split(classification_data())
    return {
        "train_dataloaders": DataLoader(Stream(train), batch_size=BATCH_SIZE),
        "val_dataloaders": DataLoader(val, batch_size=BATCH_SIZE),
    }


def _cases(*cases: Case) -> dict[str, Case]:
    return {case.name: case for case in cases}


CASES: dict[str, Case] = _cases(
    Case("item_logging", ItemLogging, lambda: loaders(classification_data()), features=("item",)),
    Case("device_tensors", DeviceTensors, lambda: loaders(sequence_data()), features=("device_tensors",)),
    Case("bool_masks", BoolMasks, lambda: loaders(classification_data()), features=("bool_masks",)),
    Case("torchmetrics", TorchMetrics, lambda: loaders(classification_data()), features=("metrics",)),
    Case("manual_optimization", ManualOptimization, lambda: loaders(classification_data()), features=("manual_optimization",)),
    Case(
        "dict_batch", DictBatch, lambda: loaders(DictDataset(classification_data())), features=("dict_batch", "dataclass_output")
    ),
    Case(
        "transformer_encoder",
        TransformerEncoderClassifier,
        lambda: {"datamodule": ZooDataModule(token_class_data)},
        features=("datamodule", "nested_layers", "shuffle"),
    ),
    Case("cnn_batchnorm", CnnBatchNorm, lambda: loaders(image_data()), batch_dependent=True, features=("batchnorm",)),
    Case("llama", Llama, lambda: loaders(token_data()), features=("fleet_layers", "gqa", "rotary")),
    Case("tied_embeddings", TiedEmbeddings, lambda: loaders(token_data()), features=("tied",)),
    Case("frozen_backbone", FrozenBackbone, lambda: loaders(classification_data()), features=("frozen",)),
    Case("lr_scheduler_step", LrSchedulerStep, lambda: loaders(classification_data()), features=("lr_scheduler",)),
    Case(
        "gradient_clipping",
        Classifier,
        lambda: loaders(classification_data()),
        trainer={"gradient_clip_val": 0.5},
        features=("gradient_clipping",),
    ),
    Case(
        "bf16_mixed", Classifier, lambda: loaders(classification_data()), trainer={"precision": "bf16-mixed"}, features=("bf16",)
    ),
    Case("subset_sampler", Classifier, _sampled, features=("custom_sampler",)),
    Case("weighted_sampler", Classifier, _weighted, features=("custom_sampler",)),
    Case("iterable", Classifier, _streamed, features=("iterable",)),
    Case("keeps_loss", KeepsLoss, lambda: loaders(classification_data()), features=("keeps_state",)),
    Case("mlp_regression", MlpRegression, lambda: loaders(regression_data()), features=("sequential",)),
    Case("two_tower", TwoTower, lambda: loaders(pair_data()), features=("tied", "buffers")),
    Case("contrastive", Contrastive, lambda: loaders(view_data()), batch_dependent=True, features=("in_batch_negatives",)),
    Case("sum_loss", SumLoss, lambda: loaders(regression_data()), batch_dependent=True, features=("sum_loss",)),
)
"""Every case by name."""


def train_loader(case: Case) -> DataLoader:
    """The case's training DataLoader (a DataModule is set up for fitting first)."""
    data = case.data()
    if "datamodule" in data:
        data["datamodule"].setup("fit")
        return data["datamodule"].train_dataloader()
    return data["train_dataloaders"]


def evaluation_kwargs(data: dict) -> dict:
    """validate/test/predict keyword arguments for a case's fit() kwargs: its DataModule, or its validation loader."""
    return {"datamodule": data["datamodule"]} if "datamodule" in data else {"dataloaders": data["val_dataloaders"]}


def example_batch(case: Case) -> Any:
    """The first training batch of a case."""
    return next(iter(train_loader(case)))



# --- "unchanged": a deep snapshot of a module (and its trainer, and the RNG streams) ------------------


def _freeze(value: Any, depth: int = 3) -> Any:
    """What must not change about one attribute value: its identity, and for tensors their values and flags, for
    containers their items (``depth`` levels down)."""
    if isinstance(value, Tensor):
        grad = value.grad if isinstance(value, nn.Parameter) else None
        data = None if value.is_meta else value.detach().clone()
        return ("tensor", id(value), data, value.device, value.dtype, value.requires_grad, None if grad is None else grad.clone())
    if depth and isinstance(value, dict):
        return ("dict", id(value), {key: _freeze(item, depth - 1) for key, item in value.items()})
    if depth and isinstance(value, (list, tuple, set)):
        items = sorted(value, key=id) if isinstance(value, set) else value
        return ("sequence", id(value), [_freeze(item, depth - 1) for item in items])
    return ("object", id(value))


def _rng_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": numpy.random.get_state(), "python": random.getstate()}


def state_snapshot(module: nn.Module, trainer: Any = None) -> dict[str, Any]:
    """Every submodule's ``__dict__`` (keys, identities, tensor values, flags, hooks), the trainer's logged values and
    result collections, and the RNG streams."""
    modules = module.named_modules(remove_duplicate=False)
    snap: dict[str, Any] = {f"module {name or '<root>'}": _freeze(m.__dict__) for name, m in modules}
    snap["rng"] = _rng_states()
    if trainer is not None:
        for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
            snap[f"trainer.{name}"] = {key: _freeze(value) for key, value in getattr(trainer, name).items()}
        results = trainer.fit_loop.epoch_loop._results
        snap["trainer results"] = {key: _freeze(result.__dict__) for key, result in results.items()}
        snap["trainer attributes"] = {key: _freeze(value, depth=0) for key, value in trainer.__dict__.items()}
    return snap


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, Tensor):
        if a.shape != b.shape:
            return False
        return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, numpy.ndarray):
        return a.shape == b.shape and bool((a == b).all())
    return a == b


def snapshot_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The snapshot entries that differ (empty when nothing changed)."""
    keys = before.keys() | after.keys()
    return sorted(key for key in keys if key not in before or key not in after or not _same(before[key], after[key]))
