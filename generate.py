"""Sample from, or chat with, a checkpoint of any training script: one process, CPU or one GPU, no torchrun.

    python generate.py runs/fsdp2_pretrain --prompt "The interpreter reads"          # continue a text
    python generate.py runs/fsdp2_sft --chat --prompt "Compute 7 - 3 + 5 - 2."       # one reply, greedy
    python generate.py runs/fsdp2_sft --chat --temperature 0.8                       # an interactive chat

CHECKPOINT is a checkpoint folder (runs/X/checkpoints/step_N), a run's --out-dir (its newest checkpoint), or a
folder written by export_hf.py.
"""
import sys
from pathlib import Path

import torch

import common
import loading
import modeling
import prepare_data
import tasks

parser = common.ArgumentParser(__doc__)
parser.add_argument("checkpoint",
                    help="a checkpoint folder, a run folder (its newest checkpoint is used), or an export_hf.py folder")
parser.add_argument("--prompt", default=None,
                    help="text to continue; with --chat, the user's message (no prompt: an interactive chat)")
parser.add_argument("--chat", action="store_true",
                    help="treat the prompt as a user turn of the SFT chat format; stop at the end of the reply")
parser.add_argument("--system", default=None,
                    help="system message for --chat (default: the built-in set's, for a model finetuned on it)")
parser.add_argument("--max-new-tokens", type=common.COUNT, default=200, help="most tokens to generate per reply")
parser.add_argument("--temperature", type=common.NON_NEGATIVE, default=0.0, help="sampling temperature; 0 = greedy")
parser.add_argument("--top-k", type=common.NON_NEGATIVE_INT, default=50,
                    help="sample among the k most likely tokens (with --temperature > 0; 0 = all)")
parser.add_argument("--seed", type=common.NON_NEGATIVE_INT, default=1337, help="seeds the sampling")
parser.add_argument("--base", default=None, help="a LoRA run: where its base lies now, if moved (default: where the "
                    "run recorded it)")
args = parser.parse_args()
if not args.chat and args.prompt is None:
    parser.error("--prompt is required without --chat")

device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
checkpoint_dir = loading.resolve_checkpoint(args.checkpoint)
model, meta = loading.load_checkpoint_model(checkpoint_dir, device, args.base)
source = f"{meta['script']}.py, step {meta['step']}"
if "export" in meta:  # an export_hf.py folder: its checkpoint's meta.json, and where it came from
    source = f"exported from {source}"
print(f"loaded {checkpoint_dir} ({source}), model '{meta['model']}'", file=sys.stderr)  # stdout: the text alone
tokenizer = common.get_chat_tokenizer()  # GPT-2 BPE plus the SFT markers, which a pretrained model never saw
torch.manual_seed(args.seed)


def reply(prompt_tokens):
    with torch.no_grad():
        new_tokens = modeling.generate_replies(model, [prompt_tokens], args.max_new_tokens, args.temperature,
                                               args.top_k)[0]
    if new_tokens and new_tokens[-1] in (common.SPECIAL_TOKENS[common.END_OF_TURN], common.EOT_ID):
        new_tokens = new_tokens[:-1]  # the stop marker ends the reply; it is not part of it
    text = common.decode(tokenizer, new_tokens)  # the vocabulary's padding rows decode to nothing
    if text and not text.strip():  # a model that learned only line breaks: one line, not a screen of blank ones
        print(f"note: the model's {len(new_tokens)} new tokens are whitespace only: an undertrained model",
              file=sys.stderr)
        text = ""
    return text, new_tokens


if not args.chat:  # a pretrained (or any) model continues plain text
    print(args.prompt + reply(tokenizer.encode_ordinary(args.prompt))[0])
    sys.exit(0)

builtin_data = Path(str(meta.get("data"))).name in ("builtin-sft", "builtin-rl")  # prepare_data.py's built-in sets
builtin_system = tasks.BUILTIN_SYSTEM_PROMPT if builtin_data else ""
system = args.system if args.system is not None else builtin_system
if not meta.get("chat_format"):
    print("note: this model never learned the chat format (a pretraining checkpoint): expect no reply", file=sys.stderr)
if system and args.system is None:  # said, so that a reply elsewhere (the export's chat template) can match it
    print(f"system message: {system!r}, the built-in set's (--system to change)", file=sys.stderr)
conversation = [("system", system)] if system else []
while True:
    try:
        message = args.prompt if args.prompt is not None else input("user> ")
    except (EOFError, KeyboardInterrupt):  # Ctrl-D (or Ctrl-C) at the prompt ends the chat
        print()
        break
    conversation.append(("user", message))
    prompt_tokens, _ = prepare_data.encode_conversation(tokenizer, conversation)
    text, new_tokens = reply(prompt_tokens + [common.SPECIAL_TOKENS[common.ROLE_MARKERS["assistant"]]])
    print(text if args.prompt is not None else f"assistant> {text}")
    if args.prompt is not None:
        break
    conversation.append(("assistant", text))
