"""The RL methods, one LightningModule each, on a thin shared base; and everything a new method is written against.

A method author's one import (``docs/adding-a-method.md``)::

    from lit_rl.methods import BACKWARD, OPTIMIZER, RLMethod, RolloutShape, StepWork, sample_completions

``RLMethod`` is the base and its docstring the contract; ``BACKWARD`` and ``OPTIMIZER`` the phases every method's
``phase_names`` ends with; ``RolloutShape`` and ``StepWork`` what its ``rollout_shape()`` and ``step_work()`` hooks
return; ``sample_completions`` the sampler the built-in methods draw their rollouts with
(:mod:`lit_rl.models.sampling`). The token math and model helpers stay in :mod:`lit_rl.ops` and :mod:`lit_rl.models`.

A variant of GumbelTopK's differentiable rollout overrides its ``soft_rollout`` hook, which returns a
``SoftRollout``, and steps the models with ``PolicyStepper`` and ``ReferenceStepper`` exactly as the method does
(``bench/gumbel_legacy.py``, the full-vocabulary baseline, is one). A method whose loss is differentiated through
its rollout declares it in ``step_work()`` as a ``DifferentiableRollout``, for the roofline.
"""

from lit_rl.memory.phases import BACKWARD, OPTIMIZER
from lit_rl.memory.rollout import DifferentiableRollout, RolloutShape, StepWork
from lit_rl.methods.base import RLMethod
from lit_rl.methods.grpo import RefCachedGRPO
from lit_rl.methods.gumbel_topk import GumbelTopK, PolicyStepper, ReferenceStepper, SoftRollout
from lit_rl.methods.intuitor import Intuitor
from lit_rl.models import sample_completions

__all__ = [
    "BACKWARD",
    "OPTIMIZER",
    "DifferentiableRollout",
    "GumbelTopK",
    "Intuitor",
    "PolicyStepper",
    "RLMethod",
    "RefCachedGRPO",
    "ReferenceStepper",
    "RolloutShape",
    "SoftRollout",
    "StepWork",
    "sample_completions",
]
