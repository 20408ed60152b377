"""The model: transformers' Qwen2 (the model class only) with the GPT-2 vocabulary, activation checkpointing on every
decoder layer, a forward that returns the loss without ever holding a whole batch's logits, and generation with it."""
import contextlib
import functools

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from common import END_OF_TURN, EOT_ID, IGNORE_INDEX, MODEL_PRESETS, SPECIAL_TOKENS, VOCAB_SIZE


class ChunkedLoss:
    """A causal LM whose forward, given targets, is the summed loss (inside it: the wrappers' hooks cover the head)."""
    loss_chunk_rows = None  # build_model's: None, the device's LOSS_CHUNK_ROWS

    def forward(self, input_ids=None, targets=None, weights=None, position_ids=None, **kwargs):
        if targets is None and weights is None:  # transformers' own (labels=: its loss on full logits, as Trainer's)
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if targets is None or kwargs:  # with targets, no other argument may be dropped silently
            raise ValueError(f"a loss takes targets, and input_ids, position_ids or weights: got {sorted(kwargs)}")
        # The layers' mask given (None: causal; padding is on the right): transformers' checks for packed rows, a wait.
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask={"full_attention": None})
        return chunked_cross_entropy(hidden[0], self.lm_head.weight, targets, weights, self.loss_chunk_rows)


class Qwen2WithChunkedLoss(ChunkedLoss, transformers.Qwen2ForCausalLM):
    """transformers' Qwen2ForCausalLM, its forward ChunkedLoss's."""


def build_model(preset, activation_checkpointing="full", loss_chunk_rows=None, fake=False,
                model_class=Qwen2WithChunkedLoss, config_class=transformers.Qwen2Config, **experts):
    """A Qwen2WithChunkedLoss (GPT-2 vocabulary, checkpointed layers) in transformers' init: first loss ln(50,304)."""
    rope = {"rope_type": "default", "rope_theta": MODEL_PRESETS[preset]["rope_theta"]}
    with torch.device("meta") if fake else contextlib.nullcontext():  # fake: transformers' init needs no values
        model = model_class(config_class(
            vocab_size=VOCAB_SIZE, **MODEL_PRESETS[preset]["model"], max_position_embeddings=32_768,
            rope_parameters=rope, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02, **experts,
            bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID, use_cache=False, attn_implementation="sdpa"))
    if fake:  # real inputs meet them as fake tensors too (allow_non_fake_inputs), so every op after yields shapes only
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gave the head a tensor of its own: the embedding's again
    model.loss_chunk_rows = loss_chunk_rows
    if activation_checkpointing != "none":  # recompute each decoder layer in backward, instead of keeping activations
        checkpoint_kwargs = {"use_reentrant": False}
        if activation_checkpointing == "selective":  # torch's selective checkpointing: a list of the ops to keep
            checkpoint_kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                                SELECTIVE_CHECKPOINT_SAVES)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        # transformers also hooks the embedding to make its output require grad, even under no_grad: only reentrant
        # checkpointing needs that, and under --compile it costs every bucket a third graph (evaluation, first layer).
        model.disable_input_require_grads()
    return model


# Mixture-of-Experts shapes (fsdp2_ep_pretrain.py): a dense preset's attention and depth, each layer's MLP replaced by
# E routed experts, k of them per token, beside a shared expert: the active width, k x expert + shared, the dense one's.
MOE_PRESETS = {
    "tiny-moe": ("tiny", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                              shared_expert_intermediate_size=64)),  # 2 x 96 + 64 = tiny's 256
    "small-moe": ("small", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                                shared_expert_intermediate_size=128)),  # 2 x 192 + 128 = small's 512
    "qwen2-0.5b-moe": ("qwen2-0.5b", dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=480,
                                          shared_expert_intermediate_size=1024)),  # 8 x 480 + 1,024 = 4,864
}


class Qwen2MoeWithChunkedLoss(ChunkedLoss, transformers.Qwen2MoeForCausalLM):
    """transformers' Qwen2MoeForCausalLM, its forward ChunkedLoss's."""


def build_moe_model(preset, activation_checkpointing="full", loss_chunk_rows=None, fake=False):
    """build_model's model with a MOE_PRESETS preset's experts: top-k probabilities renormalized (Qwen3-MoE's way)."""
    dense, experts = MOE_PRESETS[preset]
    return build_model(dense, activation_checkpointing, loss_chunk_rows, fake, Qwen2MoeWithChunkedLoss,
                       transformers.Qwen2MoeConfig, **experts, norm_topk_prob=True)


# Selective checkpointing keeps the outputs of these ops (the matmuls and attention: nearly all of a layer's
# FLOPs) and recomputes everything else (norms, rotary, SiLU, residual adds: cheap, but many activations).
SELECTIVE_CHECKPOINT_SAVES = [
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
]


# Rows of logits per chunk, unless --loss-chunk-rows. CPU: 128 x 50,304 fp32 logits are 26 MB, under glibc's 32 MB
# mmap threshold, so the same memory is reused instead of being page-faulted in afresh every step. GPU: big matmuls.
LOSS_CHUNK_ROWS = {"cpu": 128, "cuda": 4096}


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of hidden @ weight.T (rows times row_weights, if given), a chunk at a time, and (needs_grad)
    each chunk's gradients at once: no chunk's logits outlive it, the plain loss's FLOPs in a fraction of its memory."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, rows, needs_grad):
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        # Made like hidden, not like weight: FSDP's gathered weight sits in its own buffer, real even in a fake run.
        grad_weight = hidden.new_zeros(weight.shape, dtype=torch.float32) if needs_grad else None
        for chunk in (slice(start, start + rows) for start in range(0, len(hidden), rows)):
            chunk_weights = None if row_weights is None else row_weights[chunk].float()
            chunk_loss, grad_logits = logit_losses(hidden[chunk], weight, targets[chunk], chunk_weights, needs_grad)
            loss += chunk_loss
            if needs_grad:
                grad_hidden[chunk] = grad_logits @ weight
                grad_weight += grad_logits.T @ hidden[chunk]
        if needs_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None


def logit_losses(hidden, weight, targets, row_weights, needs_grad):
    """A chunk's summed loss and (needs_grad) its gradient with respect to its logits, in hidden's dtype."""
    logits = (hidden @ weight.T).float()  # in the compute dtype (bf16 under mixed precision), then fp32
    log_normalizer = logits.logsumexp(dim=-1)
    losses = log_normalizer - logits.gather(1, targets[:, None]).squeeze(1)
    loss = (losses if row_weights is None else row_weights * losses).sum()
    if not needs_grad:
        return loss, None
    grad_logits = logits.sub_(log_normalizer[:, None]).exp_()  # softmax, in place
    grad_logits[torch.arange(len(targets), device=targets.device), targets] -= 1  # made on the device: no copy to it
    if row_weights is not None:
        grad_logits.mul_(row_weights[:, None])
    return loss, grad_logits.to(hidden.dtype)


def chunked_cross_entropy(hidden, weight, targets, weights=None, rows=None):
    """Sum of -log p(target) (times weights, if given) where the target is not IGNORE_INDEX: logits only there, so
    padding and prompts cost nothing in the head; `rows` of logits at a time. Eager: its shapes hang on the data."""
    is_target = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # indices of real targets index fake hidden states
    row_weights = None if weights is None else weights[is_target]
    rows = rows or LOSS_CHUNK_ROWS.get(hidden.device.type, 4096)
    return ChunkedCrossEntropy.apply(hidden[is_target], weight, targets[is_target], row_weights, rows,
                                     torch.is_grad_enabled())


def flops_per_token(n_params, config, seq_len):
    """Model FLOPs per trained token (PaLM, appendix B): 6N for the matmuls plus 12*L*H*Q*T for attention scores;
    activation checkpointing's recompute is not the model's, so not counted."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 6 * n_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len


def local_state_sizes(model, optimizer):
    """Elements of parameters and of optimizer state this rank really stores (a DTensor counts its shard)."""
    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    return (sum(local(p).numel() for p in model.parameters()),
            sum(local(v).numel() for state in optimizer.state.values() for v in state.values()
                if torch.is_tensor(v) and v.dim() > 0))  # AdamW's moments, not its step counters


class InverseCdfSampler(transformers.LogitsProcessor):
    """Draws each row's next token by inverse CDF, leaving only its score finite for a greedy step: transformers'
    distribution without torch.multinomial, most of a sampled reply's time on a CPU (pytorch#30968; BENCHMARKS.md)."""

    def __call__(self, input_ids, scores):
        cumulative = torch.softmax(scores, dim=-1).cumsum(dim=-1)
        uniform = torch.rand(len(scores), 1, device=scores.device) * cumulative[:, -1:]
        drawn = torch.searchsorted(cumulative, uniform, right=True).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


def generate_replies(model, prompts, max_new_tokens, temperature=0.0, top_k=None, synced=False):
    """The new tokens of each prompt (token lists), up to and with its stop token, from transformers' generate with left
    padding; synced=True keeps every rank stepping until all are done, as sharded models need."""
    drop = not prompts
    prompts = prompts or [[EOT_ID]]  # a rank with no prompt still has to join the collective forwards
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[EOT_ID] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = {}
    if temperature > 0:  # greedy decoding over scores in which only the drawn token is finite (InverseCdfSampler)
        top_k_warper = [transformers.TopKLogitsWarper(top_k)] if top_k else []
        warpers = [transformers.TemperatureLogitsWarper(temperature), *top_k_warper, InverseCdfSampler()]
        sampling = dict(logits_processor=transformers.LogitsProcessorList(warpers))
    with torch.compiler.set_stance("force_eager"):  # under --compile, every generated length would be a new graph
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                eos_token_id=[SPECIAL_TOKENS[END_OF_TURN], EOT_ID], pad_token_id=EOT_ID,
                                do_sample=False, use_cache=True, synced_gpus=synced, **sampling)
    stops = (SPECIAL_TOKENS[END_OF_TURN], EOT_ID)  # generate pads a finished reply to the longest with EOT: cut that
    replies = [row[width:].tolist() for row in output]
    replies = [next((reply[:i + 1] for i, token in enumerate(reply) if token in stops), reply) for reply in replies]
    return [] if drop else replies
