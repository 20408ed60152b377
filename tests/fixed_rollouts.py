"""Run fsdp2_grpo.py with rollouts the test fixes, as tests/crash.py does: the library calls are patched, the
script runs unchanged as __main__.

    ROLLOUTS=answer-by-sample torchrun --nproc_per_node=2 tests/fixed_rollouts.py fsdp2_grpo.py [flags]

ROLLOUTS (the sampled replies; greedy evaluation is left alone):
    constant          every reply is "The answer is 7." between the solution markers: all rewards of a group equal
    answer-by-sample  reply j of a group answers j: rewards differ within a group, the same on any number of ranks
    uneven            real sampling, but rank 0 stops after 1 token while the others run to the end
"""
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import modeling  # noqa: E402
from helpers import reply_saying  # noqa: E402

mode, rank = os.environ["ROLLOUTS"], int(os.environ.get("RANK", 0))
real_generate_replies = modeling.generate_replies


def generate_replies(model, prompts, max_new_tokens, temperature=0.0, top_k=None, synced=False):
    if temperature == 0:  # evaluation: as it is
        return real_generate_replies(model, prompts, max_new_tokens, temperature, top_k, synced)
    if mode == "uneven":
        return real_generate_replies(model, prompts, 1 if rank == 0 else max_new_tokens, temperature, top_k, synced)
    places = []  # a reply's place in its group: a group's prompts come one after another
    for i, prompt in enumerate(prompts):
        places.append(places[-1] + 1 if i and prompts[i - 1] == prompt else 0)
    return [reply_saying(7 if mode == "constant" else place % 10) for place in places]


modeling.generate_replies = generate_replies
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
