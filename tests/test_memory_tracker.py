"""TensorMemoryTracker: exact byte counts for allocations, frees, views, in-place ops, autograd and fake tensors."""

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lit_rl.memory.tracker import CATEGORIES, TensorMemoryTracker
from lit_rl.models.tiny import tiny_model


def _param_bytes(module: torch.nn.Module) -> int:
    storages = {id(p.untyped_storage()): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


def test_matmul_allocates_exactly_its_output():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with TensorMemoryTracker() as t:
        c = a @ b
    assert t.current_bytes == 64 * 16 * 4
    assert t.by_category()["activations"] == 64 * 16 * 4
    del c


def test_free_lowers_current_and_peak_is_the_max():
    with TensorMemoryTracker() as t:
        x = torch.empty(1000)  # 4000 B
        y = torch.empty(500, dtype=torch.float64)  # 4000 B
        assert t.current_bytes == 8000
        del x
        assert t.current_bytes == 4000
        z = torch.empty(100, dtype=torch.int8)
    assert t.current_bytes == 4100
    assert t.peak_bytes == 8000
    t.reset_peak()
    assert t.peak_bytes == 4100
    del y, z
    gc.collect()
    assert t.current_bytes == 0  # frees are counted after the tracker is exited too
    assert t.peak_bytes == 4100


def test_views_and_inplace_are_not_counted_again():
    base = torch.randn(10, 10)  # pre-existing: not the tracker's business
    with TensorMemoryTracker() as t:
        base.add_(1)
        v = base.view(100)
        assert t.current_bytes == 0
        c = base * 2  # 400 B
        views = [c.t(), c[2:], c.view(-1), c.unsqueeze(0), c.detach()]
        c.mul_(3).relu_()
        assert t.current_bytes == 400
        del c
        assert t.current_bytes == 400  # the views keep the storage alive
        del views
        assert t.current_bytes == 0
    del v


def test_torch_tensor_literal_is_counted():
    with TensorMemoryTracker() as t:
        x = torch.tensor([1.0, 2.0, 3.0])
    assert t.current_bytes == 12
    del x


def test_no_grad_and_autograd_unchanged():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    (x @ w).tanh().sum().backward()
    expected = w.grad.clone()
    w.grad = None
    with TensorMemoryTracker() as t:
        with torch.no_grad():
            y = x @ w
        assert not y.requires_grad
        (x @ w).tanh().sum().backward()
    torch.testing.assert_close(w.grad, expected)
    assert t.peak_bytes > 0


def test_module_and_optimizer_categories_are_exact():
    model = tiny_model(num_layers=2)
    opt = torch.optim.AdamW(model.parameters())
    params = _param_bytes(model)
    ids = torch.randint(0, 128, (2, 16))
    t = TensorMemoryTracker().track(model).track(opt)
    assert t.by_category()["parameters"] == params
    with t:
        loss = model(ids).logits.float().logsumexp(-1).mean()
        assert t.by_category()["activations"] > 0
        with t.category("temporaries"):
            loss.backward()
        del loss
        assert t.by_category()["gradients"] == params  # one float32 grad per trainable parameter
        assert t.by_category()["activations"] == 0  # the graph is freed after backward
        opt.step()
        opt.zero_grad()
    cats = t.by_category()
    assert cats["gradients"] == 0
    n_params = len(list(model.parameters()))
    assert cats["optimizer_state"] == 2 * params + 4 * n_params  # exp_avg, exp_avg_sq and a float32 step each
    assert t.peak_bytes >= params * 2 + t.peak_by_category()["activations"]
    assert set(t.peak_by_category()) == set(CATEGORIES)
    t.close()


def test_uncounted_categories_are_filed_but_left_out_of_current_and_peak():
    """What lives in host memory while a device is counted (FSDP2's cpu_offload): the same run, counted twice."""

    def run(uncounted: tuple[str, ...]) -> tuple:
        torch.manual_seed(0)
        model = tiny_model(num_layers=2)
        opt = torch.optim.AdamW(model.parameters())
        t = TensorMemoryTracker(uncounted=uncounted).track(model).track(opt)
        with t:
            model(torch.randint(0, 128, (2, 16))).logits.float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        t.close()
        return t, model, opt  # the model and optimizer stay alive: their storages stay counted

    host = ("parameters", "gradients", "optimizer_state")
    runs = run(()), run(host)  # each tracker with its model and optimizer, alive to the end of the test
    everything, device = runs[0][0], runs[1][0]
    assert device.by_category() == everything.by_category()  # filed the same
    stays = sum(v for k, v in everything.by_category().items() if k not in host)
    assert device.current_bytes == stays < everything.current_bytes
    assert 0 < device.peak_bytes < everything.peak_bytes
    counted_at_peak = sum(v for k, v in device.peak_by_category().items() if k not in host)
    assert device.peak_bytes == counted_at_peak  # the peak is the counted categories' moment, not the total's
    with pytest.raises(ValueError):
        TensorMemoryTracker(uncounted=("weights",))


def test_frozen_lora_base_weights_do_not_crash():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    t = TensorMemoryTracker().track(model)
    with t:
        model(torch.randint(0, 128, (2, 8))).logits.sum().backward()
    assert t.by_category()["gradients"] == trainable
    assert t.by_category()["parameters"] == _param_bytes(model)
    t.close()


def test_fake_tensors_are_counted_from_storage_size():
    with FakeTensorMode():
        a = torch.empty(1024, 1024)
        with TensorMemoryTracker() as t:
            b = a @ a
            c = b.relu()
            assert t.current_bytes == 2 * 1024 * 1024 * 4
            del c
            assert t.current_bytes == 1024 * 1024 * 4
        del b


def test_device_filter_and_bad_inputs():
    with TensorMemoryTracker(device_type="cuda") as t:
        x = torch.empty(100)
    assert t.current_bytes == 0
    with pytest.raises(ValueError, match="unknown memory category"):
        TensorMemoryTracker(default_category="weights")
    with pytest.raises(TypeError, match="cannot track"):
        TensorMemoryTracker().track(3)
    del x


def test_storage_resizes_are_counted_as_fsdp2_frees_and_gathers_weights():
    """FSDP2 frees a gathered weight by resizing its storage to 0 bytes and gathers into the same storage later;
    neither is an operator, and the storage may predate the tracker (kept from an earlier step)."""
    kept = torch.empty(1000)  # 4000 B, allocated before any tracker: a gathered weight from an earlier step
    kept.untyped_storage().resize_(0)
    with TensorMemoryTracker() as t:
        x = torch.empty(250)  # 1000 B
        x.untyped_storage().resize_(0)
        assert t.current_bytes == 0 and t.peak_bytes == 1000
        kept.untyped_storage().resize_(4000)  # gathered again: counted from now on
        assert t.current_bytes == 4000
        kept.untyped_storage().resize_(0)
        x.untyped_storage().resize_(1000)
        assert t.current_bytes == 1000 and t.peak_bytes == 4000
    outside = torch.empty(10)
    outside.untyped_storage().resize_(0)  # no tracker is entered: nothing is counted, nothing fails
    assert t.current_bytes == 1000


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_weight_packed_for_onednn_counts_its_dense_bytes_until_freed():
    """An opaque oneDNN tensor has no storage: the tracker counts the tensor itself, once, at its dense bytes."""
    cast = torch.randn(64, 48).to(torch.bfloat16)
    x = torch.randn(8, 48).to(torch.bfloat16)
    with TensorMemoryTracker() as t:
        packed = torch.ops.mkldnn._reorder_linear_weight(cast)
        assert t.current_bytes == 64 * 48 * 2
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # the packed input is not new
        assert t.current_bytes == 64 * 48 * 2 + 8 * 64 * 2
        del packed
        gc.collect()
    assert t.current_bytes == 8 * 64 * 2 and t.peak_bytes == 64 * 48 * 2 + 8 * 64 * 2
    del y
