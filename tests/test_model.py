"""Model presets: the recipe's exact shape, tied embeddings, checkpointing on every layer, sane init."""
import math

import torch

import common
import modeling


def test_qwen2_preset_has_the_recipe_parameter_count():
    with torch.device("meta"):  # shapes only: no memory, no init
        model = modeling.build_model("qwen2-0.5b")
    assert model.num_parameters() == 402_970_496
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (896, 4864, 24)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (14, 2, 50_304)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_activation_checkpointing_is_on_for_every_decoder_layer():
    for preset in common.MODEL_PRESETS:
        with torch.device("meta"):
            model = modeling.build_model(preset)
        assert all(layer.gradient_checkpointing for layer in model.model.layers), preset


def test_checkpointing_recomputes_in_backward_and_gives_the_same_gradients():
    torch.manual_seed(0)
    model = modeling.build_model("tiny")
    input_ids = torch.randint(0, 50_257, (2, 16))
    model.train()
    model(input_ids=input_ids).logits.square().mean().backward()
    with_checkpointing = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for layer in model.model.layers:
        layer.gradient_checkpointing = False
    model(input_ids=input_ids).logits.square().mean().backward()
    for a, b in zip(with_checkpointing, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_without_checkpointing_no_layer_recomputes_and_the_gradients_are_the_same():
    """--activation-checkpointing none: every layer keeps its activations, and the loss's gradients equal full
    checkpointing's."""
    input_ids = torch.randint(0, 50_257, (2, 16), generator=torch.Generator().manual_seed(0))
    gradients = {}
    for setting in ("full", "none"):
        torch.manual_seed(0)
        model = modeling.build_model("tiny", setting)
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [setting == "full"] * 2
        model(input_ids=input_ids, targets=input_ids).backward()
        gradients[setting] = [p.grad for p in model.parameters()]
    for a, b in zip(gradients["full"], gradients["none"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_initial_loss_is_uniform_over_the_vocabulary():
    torch.manual_seed(0)
    model = modeling.build_model("small")
    input_ids = torch.randint(0, 50_257, (4, 64))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    assert abs(loss.item() - math.log(common.VOCAB_SIZE)) < 0.5


def test_flops_per_token_formula():
    with torch.device("meta"):
        model = modeling.build_model("qwen2-0.5b")
    n = model.num_parameters()
    # 6N + 12 * layers * heads * head_dim * seq_len, at seq_len 2048
    assert modeling.flops_per_token(n, model.config, 2048) == 6 * 402_970_496 + 12 * 24 * 14 * 64 * 2048


def test_chunked_loss_equals_the_plain_loss_and_its_gradients():
    """model(input_ids, targets=...) never builds the whole batch's logits; it must still be the plain
    summed cross-entropy over the non-ignored targets, with the same gradient for every parameter."""
    torch.manual_seed(0)
    model = modeling.build_model("tiny")
    model.train()
    input_ids = torch.randint(0, 50_257, (3, 150))  # 330 targets: three 128-row chunks on CPU, the last one short
    targets = torch.randint(0, 50_257, (3, 150))
    targets[:, :30] = common.IGNORE_INDEX  # a prompt
    targets[2, 120:] = common.IGNORE_INDEX  # padding
    chunked = model(input_ids=input_ids, targets=targets)
    chunked.backward()
    chunked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=input_ids).logits
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    plain.backward()
    assert int((targets != common.IGNORE_INDEX).sum()) > 2 * modeling.LOSS_CHUNK_ROWS["cpu"]
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked_grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        torch.testing.assert_close(model(input_ids=input_ids, targets=targets), plain.detach(), rtol=1e-5, atol=1e-5)


def test_the_chunked_loss_takes_bf16_as_fsdp2s_mixed_precision_gives_it():
    """Under FSDP2's MixedPrecisionPolicy the hidden states and the gathered head are bf16 (DDP's autocast gives fp32
    hidden states): the loss is fp32 and its gradients are bf16, each near the fp32 computation's, over several
    chunks (`rows`)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(300, 64), torch.randn(1000, 64) / 8
    targets = torch.randint(0, 1000, (300,))
    targets[:20] = common.IGNORE_INDEX
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        h, w = hidden.to(dtype).detach().requires_grad_(), weight.to(dtype).detach().requires_grad_()
        loss = modeling.chunked_cross_entropy(h, w, targets, rows=64)
        loss.backward()
        assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == dtype
        results.append((loss, h.grad.float(), w.grad.float()))
    for fp32, bf16 in zip(*results):
        torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.05)


def test_a_weighted_loss_is_the_plain_weighted_sum_with_its_gradients():
    """weights=: each target's -log p times its weight (GRPO: its reply's advantage), summed; its gradients are the
    plain weighted sum's, worked out in the forward as the unweighted loss's are."""
    torch.manual_seed(0)
    model = modeling.build_model("tiny").train()
    input_ids, targets = torch.randint(0, 50_257, (3, 150)), torch.randint(0, 50_257, (3, 150))
    targets[:, :30] = common.IGNORE_INDEX  # a prompt
    targets[2, 120:] = common.IGNORE_INDEX  # padding
    row_weights = torch.tensor([0.75, -0.25, -0.5])  # an advantage per row
    weighted = model(input_ids=input_ids, targets=targets, weights=row_weights[:, None].expand_as(targets))
    weighted.backward()
    chunked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=input_ids).logits
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(3, 150)
    (row_weights[:, None] * plain).sum().backward()
    torch.testing.assert_close(weighted, (row_weights[:, None] * plain).sum().detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked_grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model.zero_grad()
    no_targets = torch.full_like(targets, common.IGNORE_INDEX)
    nothing = model(input_ids=input_ids, targets=no_targets, weights=row_weights[:, None].expand_as(targets))
    nothing.backward()  # a rank with nothing to learn still gives every parameter a gradient: zero
    assert nothing == 0 and all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_selective_checkpointing_recomputes_no_matmul_and_gives_the_same_gradients():
    """Full checkpointing runs each decoder layer's forward again in backward (all but its last matmul, whose output
    backward never needs); selective keeps the matmul outputs, so it counts exactly the FLOPs of no checkpointing.
    (FlopCounterMode counts matmuls; it has no formula for CPU attention.)"""
    from torch.utils.flop_counter import FlopCounterMode

    input_ids, targets = torch.randint(0, 50_257, (2, 32)), torch.randint(0, 50_257, (2, 32))
    flops, grads = {}, {}
    for mode in ("full", "selective", "none"):
        torch.manual_seed(0)
        model = modeling.build_model("tiny", "full" if mode == "none" else mode).train()
        for layer in model.model.layers:
            layer.gradient_checkpointing = mode != "none"
        with FlopCounterMode(display=False) as counter:
            model(input_ids=input_ids, targets=targets).backward()
        flops[mode], grads[mode] = counter.get_total_flops(), [p.grad for p in model.parameters()]
    assert flops["selective"] == flops["none"] < flops["full"]
    for mode in ("full", "selective"):
        for ours, reference in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


def test_the_sampler_draws_from_the_softmax_and_generate_keeps_to_the_top_k():
    scores = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]]).repeat(100_000, 1)
    torch.manual_seed(0)
    kept = modeling.InverseCdfSampler()(None, scores)
    assert (kept == 0).sum(dim=1).eq(1).all() and torch.isinf(kept).sum() == 4 * len(scores)  # one finite score a row
    drawn = kept.argmax(dim=1)
    shares = torch.bincount(drawn, minlength=5) / len(drawn)
    # Within 4 standard errors of each probability; a token of probability 0 is never drawn.
    assert torch.allclose(shares, torch.softmax(scores[0], dim=0), atol=4 * math.sqrt(0.25 / len(drawn)))
    assert shares[3] == 0
    model = modeling.build_model("tiny").eval()
    prompts = [[1, 2, 3], [4, 5]]
    torch.manual_seed(1)
    first = modeling.generate_replies(model, prompts, 12, temperature=1.0, top_k=1)
    assert first == modeling.generate_replies(model, prompts, 12)  # top-1 sampling is greedy decoding
    torch.manual_seed(2)
    sampled = modeling.generate_replies(model, prompts, 12, temperature=1.0)
    torch.manual_seed(2)
    assert sampled == modeling.generate_replies(model, prompts, 12, temperature=1.0)  # the seed fixes the draws
