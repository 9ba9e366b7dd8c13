"""Training on a window of the device's data buffer.

A visit leaves ``train_len`` bytes of the holder's training tokens followed by ``val_len`` bytes of
its held-out tokens in the data buffer. :meth:`Trainer.train_on_window` runs ``steps_per_visit``
AdamW steps on random contiguous sequences cut from the training part; :meth:`Trainer.eval_on_window`
computes the held-out loss. Batches are gathered straight from the buffer's bytes on the device, so
no copy of the holder's data is made outside the device beyond the batch itself.

All randomness (initialisation and batch sampling) comes from the trainer's own ``torch.Generator``
seeded with ``TrainSettings.seed``: on the CPU, two trainers with the same seed fed the same bytes end
with bit-identical weights and optimizer state (:meth:`Trainer.model_digest`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from gputravel.core.errors import ConfigError, DataError
from gputravel.core.training.digest import DIGEST_FORMAT, FrozenHashes, combine, value_entry
from gputravel.core.training.lora import apply_lora
from gputravel.core.training.model import ModelConfig, build_model, model_config_from_dict, param_shapes_of
from gputravel.core.training.tokens import (
    TokenFormat,
    bytes_per_token,
    check_token_range,
    gather_tokens,
    vocab_size,
)
from gputravel.core.training.train_settings import TrainSettings

__all__ = ["STATE_FORMAT", "TrainSettings", "Trainer", "VisitTrainResult"]

STATE_FORMAT = 1


@dataclass(frozen=True, slots=True)
class VisitTrainResult:
    """What k steps on one holder's window did: per-step losses, tokens consumed, wall time."""

    losses: list[float]
    tokens: int
    seconds: float
    tokens_per_s: float


class Trainer:
    """The model, its AdamW optimizer, the step counter and the batch-sampling generator."""

    def __init__(self, config: ModelConfig, settings: TrainSettings, device: torch.device | str) -> None:
        if settings.seq_len > config.block_size:
            raise ConfigError(f"seq_len {settings.seq_len} exceeds the model's block_size {config.block_size}")
        self.config = config
        self.settings = settings
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(settings.seed)  # CPU: same stream on every device
        self.model = build_model(config, generator=self.generator, device=self.device)
        self.lora = settings.lora(config)
        #: with LoRA, the adapters: the only parameters that train, and all a checkpoint's model holds
        self.trainable: list[str] | None = None
        if self.lora is not None:
            self.trainable = apply_lora(self.model, self.lora, param_shapes_of(config), settings.seed)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=(0.9, 0.95), eps=1e-8,
        )
        self.step = 0
        #: frozen tensors' digest entries, kept between digests (whoever writes the model behind torch's back
        #: calls ``frozen_hashes.forget()``: the device's restore does)
        self.frozen_hashes = FrozenHashes()

    # --- windows --------------------------------------------------------------------------------
    def _window(self, buf: torch.Tensor, off: int, length: int, fmt: TokenFormat, what: str) -> torch.Tensor:
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise DataError(f"the data buffer must be a 1-D torch.uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if off < 0 or length < 0 or off + length > buf.numel():
            raise DataError(f"{what} window [{off}, {off + length}) lies outside the {buf.numel()}-byte buffer")
        if length % bytes_per_token(fmt):
            raise DataError(f"{what} window of {length} bytes is not a whole number of {fmt.value} tokens")
        window = buf[off: off + length]
        check_token_range(window, fmt, self.config.vocab_size)
        return window

    def _check_vocab(self, fmt: TokenFormat) -> None:
        if fmt is TokenFormat.U32 or (fmt is TokenFormat.U16 and hasattr(self.config, "arch")):
            return  # a model's own tokenizer's shards: each window's ids are checked against its vocabulary
        if vocab_size(fmt) > self.config.vocab_size:
            raise ConfigError(f"{fmt.value} tokens need a vocabulary of {vocab_size(fmt)}, the model has "
                              f"{self.config.vocab_size}")

    def train_on_window(self, buf: torch.Tensor, *, train_off: int, train_len: int, fmt: TokenFormat | str,
                        steps: int | None = None, budget_s: float | None = None) -> VisitTrainResult:
        """Run ``steps`` (default ``steps_per_visit``) steps on random sequences from
        ``buf[train_off : train_off + train_len]``; with ``budget_s``, stop after the first step that ends
        ``budget_s`` seconds or more after the start (at least one step runs). A visit's TRAIN is one or more
        such slices; the batches, learning rates and weights are the same however it is sliced.

        Raises:
            ConfigError: ``steps`` or ``budget_s`` is not positive.
            DataError: the window is outside the buffer, not whole tokens, or shorter than ``seq_len + 1`` tokens.
        """
        if (steps is not None and (type(steps) is not int or steps < 1)) or (budget_s is not None and
                                                                            not float(budget_s) > 0):
            raise ConfigError(f"a training slice needs steps >= 1 and budget_s > 0, got {steps!r}, {budget_s!r}")
        fmt = TokenFormat(fmt)
        self._check_vocab(fmt)
        window = self._window(buf, train_off, train_len, fmt, "training")
        s = self.settings
        n_tokens = train_len // bytes_per_token(fmt)
        if n_tokens < s.seq_len + 1:
            raise DataError(f"the training part holds {n_tokens} tokens ({train_len} bytes of {fmt.value}); "
                            f"at least seq_len + 1 = {s.seq_len + 1} tokens are needed for one sequence")
        span = torch.arange(s.seq_len + 1, device=window.device)
        self.model.train()
        losses: list[float] = []
        self._sync()
        t0 = time.perf_counter()
        wanted = s.steps_per_visit if steps is None else steps
        deadline = None if budget_s is None else t0 + budget_s
        for _ in range(wanted):
            starts = torch.randint(0, n_tokens - s.seq_len, (s.batch_size, 1), generator=self.generator)
            chunk = gather_tokens(window, fmt, starts.to(window.device) + span)
            x, y = chunk[:, :-1], chunk[:, 1:]
            loss = self.step_batch(x, y)
            losses.append(float(loss.item()))  # .item() waits for the step: the clock below is the step's
            if deadline is not None and time.perf_counter() >= deadline:
                break
        self._sync()
        seconds = time.perf_counter() - t0
        tokens = len(losses) * s.batch_size * s.seq_len
        return VisitTrainResult(losses=losses, tokens=tokens, seconds=seconds,
                                tokens_per_s=tokens / seconds if seconds > 0 else float("inf"))

    def step_batch(self, x: torch.Tensor, y: torch.Tensor, *, forward: Callable[..., Any] | None = None,
                   scale: float = 1.0) -> torch.Tensor:
        """The one optimizer step, on the batch ``(x, y)``, that the single device's TRAIN and a fleet's lock-step
        step both take: the scheduled learning rate, the gradient of ``loss * scale`` (``scale`` 1: of the loss
        itself), clipping, the AdamW step, the step counter (``self.step``). ``forward`` stands in for the model
        in the forward pass: the fleet passes its DistributedDataParallel wrapper, whose gradient hook
        all-reduces every bucket over the sealed ring during the backward pass. Returns the (unscaled) loss,
        on the device.
        """
        s = self.settings
        lr = s.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = (forward or self.model)(x, y)
        assert loss is not None
        (loss if scale == 1.0 else loss * scale).backward()
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], s.grad_clip)
        self.optimizer.step()
        self.step += 1
        return cast(torch.Tensor, loss)

    @torch.no_grad()
    def eval_on_window(self, buf: torch.Tensor, *, val_off: int, val_len: int,
                       fmt: TokenFormat | str) -> float | None:
        """Mean loss over up to ``val_batches`` batches spread evenly over the held-out window.

        The sequences are non-overlapping, chosen without randomness, and the mean is over tokens.
        Returns ``None`` when the window holds fewer than ``seq_len + 1`` tokens.
        """
        fmt = TokenFormat(fmt)
        self._check_vocab(fmt)
        window = self._window(buf, val_off, val_len, fmt, "held-out")
        s = self.settings
        n_tokens = val_len // bytes_per_token(fmt)
        n_seqs = (n_tokens - 1) // s.seq_len
        if n_seqs < 1:
            return None
        wanted = min(n_seqs, s.val_batches * s.batch_size)
        # evenly spaced sequence indices, so a large held-out part is covered end to end
        picks = torch.div(torch.arange(wanted) * n_seqs, wanted, rounding_mode="floor")
        starts = (picks * s.seq_len).unsqueeze(1)
        span = torch.arange(s.seq_len + 1)
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=window.device)
        try:
            for batch in torch.split(starts, s.batch_size):
                chunk = gather_tokens(window, fmt, (batch + span).to(window.device))
                _, loss = self.model(chunk[:, :-1], chunk[:, 1:])
                assert loss is not None
                total += loss.double() * batch.numel()
        finally:
            self.model.train(was_training)
        mean: float = total.item() / wanted
        return mean

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: model, optimizer, step, sampler state, config, settings. With
        LoRA the model is its adapters alone: the frozen base is the uploaded weights (or the seed's), measured
        at the start and never changed."""
        model = self.model.state_dict()
        if self.trainable is not None:
            model = {name: model[name] for name in self.trainable}
        return {
            "format": STATE_FORMAT,
            "config": self.config.to_dict(),
            "settings": self.settings.to_dict(),
            "lora": self.state_dict_lora(),
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a different model shape is a ``ConfigError``.

        The settings of this trainer stay in force (a resumed run may change, say, the steps per visit).
        """
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(f"trainer state format {state.get('format')!r} is not {STATE_FORMAT}")
        if model_config_from_dict(dict(state["config"])) != self.config:
            raise ConfigError(f"checkpoint model {state['config']} differs from this run's {self.config.to_dict()}")
        if state.get("lora") != self.state_dict_lora():
            raise ConfigError(f"checkpoint LoRA {state.get('lora')} differs from this run's {self.state_dict_lora()}")
        if self.trainable is None:
            self.model.load_state_dict(state["model"])
        else:
            if sorted(state["model"]) != sorted(self.trainable):
                raise ConfigError("a LoRA checkpoint holds exactly the adapters of this run's model")
            self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])

    def state_dict_lora(self) -> dict[str, Any] | None:
        if self.lora is None:
            return None
        return {"rank": self.lora.rank, "alpha": self.lora.alpha, "targets": list(self.lora.targets)}

    def load_base(self, params: dict[str, torch.Tensor]) -> None:
        """Pretrained weights into the model (all its parameters but LoRA's adapters; a tied head may be left out
        or given as the embedding), before any step."""
        result = self.model.load_state_dict(params, strict=False)
        own = dict(self.model.named_parameters())  # a tied lm_head is the embedding's alias, not its own entry
        missing = {n for n in result.missing_keys if n in own} - set(self.trainable or ())
        if missing or result.unexpected_keys:
            raise ConfigError(f"weights miss {sorted(missing)[:3]} or hold unexpected {result.unexpected_keys[:3]}")

    def model_digest(self, fmt: str = DIGEST_FORMAT) -> str:
        """The state's digest in format ``fmt`` (``gputravel/model-digest/v3``, BLAKE3; ``v2``, SHA-256, to check a
        stream sealed in it; :mod:`core.training.digest`): one hash over one hash per parameter and per
        optimizer-state item, in a fixed order.

        Each tensor's entry covers its name, dtype, shape and raw bytes, so any change to a weight, a moment
        estimate or an optimizer step count changes the digest. A frozen tensor's entry is kept between digests
        while torch counts no write to it (:class:`FrozenHashes`): a LoRA visit hashes the adapters and their
        moments, not the base.
        """
        params = list(self.model.named_parameters())
        labelled = [(f"param:{name}", p) for name, p in params]
        items: list[tuple[str, Any]] = [(f"optim:{name}:{key}", value) for name, p in params
                                        for key, value in sorted(self.optimizer.state.get(p, {}).items())]
        # every tensor's entry at once, hashed side by side on the process's cores (core/training/digest.py)
        entries, moments = self.frozen_hashes.entries(
            labelled, also=[(label, v) for label, v in items if isinstance(v, torch.Tensor)], fmt=fmt)
        hashed = iter(moments)
        entries += [next(hashed) if isinstance(v, torch.Tensor) else value_entry(label, v, fmt)
                    for label, v in items]
        return combine(entries, fmt)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
