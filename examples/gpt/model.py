"""A byte-level GPT as a LightningModule, with the three optional lightning_fleet hooks.

``fleet_layers()`` names the repeated layer stack (lets the planner price full recomputation and
the strategy apply it); ``fleet_tensor_parallel()`` names the Linear weights DeepSpeed AutoTP may
split (lets the planner consider tp > 1); ``fleet_pipeline()`` gives the model as a layer sequence
plus a loss (lets the planner consider pp > 1). Nothing else in the module knows about lightning_fleet.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; the head count follows the (possibly tp-split) projection width."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x) for lin in (self.q, self.k, self.v))
        heads = q.size(-1) // self.head_dim  # local heads when AutoTP split q/k/v by columns
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer layer."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Token plus position embedding: the first pipeline layer (shares the GPT's weights)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and output projection: the last pipeline layer (shares the GPT's weights)."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(LightningModule):
    """Byte-level GPT: embeddings, ``num_layers`` blocks, final LayerNorm and an output head."""

    def __init__(
        self,
        num_layers: int = 4,
        hidden_size: int = 128,
        num_heads: int = 4,
        seq_length: int = 128,
        vocab_size: int = 256,
        learning_rate: float = 3e-4,
    ) -> None:
        """
        Args:
            num_layers: transformer layers.
            hidden_size: width of the residual stream.
            num_heads: attention heads (tensor parallelism must divide them).
            seq_length: tokens per sample.
            vocab_size: 256 for bytes.
            learning_rate: AdamW learning rate.
        """
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(seq_length, hidden_size)
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of ``idx`` (batch, time)."""
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-byte cross entropy of a batch."""
        x, y = batch
        return next_byte_loss(self(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The most likely next byte at every position."""
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, weight_decay=0.0)

    # --- lightning_fleet hooks (optional) ------------------------------------------------------

    def fleet_layers(self) -> nn.ModuleList:
        """The repeated layers: the planner may recompute them, a pipeline may split them."""
        return self.blocks

    def fleet_pipeline(self) -> dict[str, object]:
        """The model as a sequence of layers plus a loss on (last output, labels): what a pipeline splits.

        A batch is (inputs, labels); the layers share this module's weights.
        """
        return {"layers": [Embed(self.tok, self.pos), *self.blocks, Head(self.ln_f, self.head)], "loss_fn": next_byte_loss}

    def fleet_tensor_parallel(self) -> dict[str, object]:
        """Tensor-parallel patterns: column-split q/k/v and MLP fc, row-split the output projections; the layers' norms
        run on sequence shards under sequence parallelism."""
        return {
            "num_heads": self.hparams.num_heads,
            "column": [r".*\.attn\.[qkv]\.weight$", r".*\.mlp\.fc\.weight$"],
            "row": [r".*\.attn\.proj\.weight$", r".*\.mlp\.proj\.weight$"],
            "sequence": [r".*\.ln[12]\.weight$"],
        }


def perplexity(loss: float) -> float:
    """exp(loss), for reports."""
    return math.exp(loss)
