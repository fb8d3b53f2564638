"""A decoder-only byte-level language model in two styles: GPT-2 (learned positions, LayerNorm, GELU) and Llama
(rotary positions, RMSNorm, SwiGLU). Pre-norm blocks in an ``nn.ModuleList`` (each becomes its own FSDP2 unit under
the strategy's policy), output head tied to the embedding. A plain LightningModule: no sharding or FT code.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256  # bytes


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, rotary: bool) -> None:
        super().__init__()
        self.n_head, self.rotary = n_head, rotary
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=not rotary)
        self.out = nn.Linear(d_model, d_model, bias=not rotary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        if self.rotary:
            q, k = _rotate(q), _rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class _SwiGLU(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        hidden = 64 * math.ceil(8 * d_model / 3 / 64)  # Llama's 2/3 x 4d, rounded to a multiple of 64
        self.gate, self.up = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, llama: bool) -> None:
        super().__init__()
        norm = nn.RMSNorm if llama else nn.LayerNorm
        self.norm1, self.norm2 = norm(d_model), norm(d_model)
        self.attn = _Attention(d_model, n_head, rotary=llama)
        self.mlp = _SwiGLU(d_model) if llama else nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderLM(pl.LightningModule):
    """Next-byte prediction with AdamW, linear warm-up then cosine decay to 10% at ``trainer.max_steps``."""

    def __init__(self, style: str = "gpt", n_layer: int = 2, n_head: int = 4, d_model: int = 96, context: int = 64,
                 lr: float = 3e-3, weight_decay: float = 0.0, warmup_steps: int = 20) -> None:
        super().__init__()
        if style not in ("gpt", "llama"):
            raise ValueError(f"DecoderLM style must be 'gpt' or 'llama', got {style!r}")
        if d_model % n_head:
            raise ValueError(f"DecoderLM n_head={n_head} must divide d_model={d_model}: choose n_head among "
                             f"{[h for h in range(1, 17) if d_model % h == 0]}")
        if style == "llama" and (d_model // n_head) % 2:
            raise ValueError(f"DecoderLM style=llama needs an even head width (d_model / n_head), got {d_model} / "
                             f"{n_head}: rotary positions rotate pairs of channels")
        self.save_hyperparameters()
        llama = style == "llama"
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = None if llama else nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head, llama) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model) if llama else nn.LayerNorm(d_model)
        self.apply(_init)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # tied head: FSDP2 keeps the embedding in the root unit

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten()), sync_dist=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95))
        total = max(self.trainer.max_steps, hp.warmup_steps + 1)

        def factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min((step - hp.warmup_steps) / (total - hp.warmup_steps), 1.0)
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _rotate(x: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding over the last dimension (pairs of channels) of (batch, head, time, width)."""
    t, width = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, width, 2, device=x.device, dtype=torch.float32) / width)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
