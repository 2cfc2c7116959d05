"""train/algorithms/registry.py: names to implementations, and the errors for a name it does not know."""
import pytest
import torch

from train.algorithms.advantages import ESTIMATORS
from train.algorithms.kl import KL_ESTIMATORS, kl_estimate
from train.algorithms.policy_loss import POLICY_LOSSES, gspo_loss, ppo_clip_loss
from train.algorithms.registry import Registry


def test_an_unknown_name_is_refused_listing_the_valid_ones_and_the_key():
    with pytest.raises(ValueError) as e:
        ESTIMATORS.get("grpoo")
    message = str(e.value)
    assert "'grpoo'" in message and "adv.estimator" in message
    for name in ("reinforce", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"):
        assert name in message
    assert "e.g. adv.estimator=reinforce" in message


def test_register_get_names_in_registration_order():
    shapes: Registry[int] = Registry("shape", "model.shape")

    @shapes.register("square")
    def square() -> int:
        return 4

    shapes.add("triangle", lambda: 3)
    assert shapes.names() == ("square", "triangle")
    assert shapes.get("square") is square and shapes.get("triangle")() == 3
    assert "square" in shapes and "circle" not in shapes
    with pytest.raises(ValueError, match="already registered"):
        shapes.add("square", lambda: 0)  # a second entry under a name is a bug, not an override
    with pytest.raises(ValueError, match="unknown shape 'circle' .*valid: square, triangle"):
        shapes.get("circle")


def test_aliases_resolve_but_are_not_offered():
    assert KL_ESTIMATORS.names() == ("k1", "k2", "k3", "low_var_kl")  # the config's choices
    assert KL_ESTIMATORS.get("kl") is KL_ESTIMATORS.get("k1") and KL_ESTIMATORS.get("mse") is KL_ESTIMATORS.get("k2")
    lp, ref = torch.tensor([[-0.5, -2.0]]), torch.tensor([[-1.0, -1.0]])
    assert torch.equal(kl_estimate(lp, ref, "abs"), (lp - ref).abs())
    with pytest.raises(ValueError, match="abs"):  # the error lists every accepted name
        kl_estimate(lp, ref, "k4")


def test_policy_losses_are_the_registered_functions():
    assert POLICY_LOSSES.names() == ("ppo", "gspo", "cispo", "gmpo", "gpg", "dppo_tv", "dppo_kl", "sapo", "dro", "clip_cov",
                                     "kl_cov")
    assert POLICY_LOSSES.get("geo_mean") is POLICY_LOSSES.get("gmpo")  # verl's name, accepted, not offered
    assert POLICY_LOSSES.get("ppo") is ppo_clip_loss and POLICY_LOSSES.get("gspo") is gspo_loss
