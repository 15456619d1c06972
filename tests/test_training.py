"""The distillation script's data handling: validation stays unseen as data grows."""

import random

from training.train import split


def test_adding_a_data_part_never_moves_trained_answers_into_validation():
    part0 = [{"id": i} for i in range(400)]
    part1 = [{"id": 1000 + i} for i in range(400)]
    val0, train0 = split(part0, random.Random(7))
    val_again, _ = split(part0, random.Random(7))
    val1, train1 = split(part1, random.Random(7))
    assert val_again == val0  # the first part's slice does not depend on what comes after it
    assert not {r["id"] for r in val0 + val1} & {r["id"] for r in train0 + train1}
    assert len(val0) == 20 and len(train0) == 380


def test_batched_generation_with_finished_rows_dropped_matches_one_prompt_at_a_time(target_model, tokenizer):
    """The data generator's left-padded batch, compacted as rows finish, answers each prompt as the
    target alone does, and its soft labels line up with the answer tokens."""
    import torch

    from specdec.lean_llama import LeanLlamaRunner
    from training.batched import generate

    runner = LeanLlamaRunner(target_model, len(tokenizer), 512)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
               for text in ("What is 2 + 3?", "Name a color.", "Write one word about the sea.", "Say hi.")]

    def alone(prompt, eos, max_new):
        cache, out = runner.new_cache(), []
        logits = runner.forward(cache, prompt, 1)
        while len(out) < max_new:
            out.append(int(logits[-1].argmax()))
            if out[-1] in eos:
                break
            logits = runner.forward(cache, [out[-1]], 1)
        return out

    free = alone(prompts[1], set(), 3)
    eos = {free[2]}  # the second prompt stops after 3 tokens: the batch compacts while the others go on
    expected = [alone(p, eos, 10) for p in prompts]
    assert len(expected[1]) == 3 and max(map(len, expected)) > 3
    got = generate(runner, prompts, 10, 0.0, 1.0, eos, seed=0)
    assert [ids for ids, _, _ in got] == expected
    for ids, top_i, top_v in got:
        assert top_i.shape == top_v.shape == (len(ids), 20)
        assert top_i[:, 0].tolist() == ids  # greedy: the label's top token is the answer's token
        assert bool((top_v[:, :-1] >= top_v[:, 1:]).all())
        assert torch.isfinite(top_v.float()).all()


def test_held_out_prompts_share_no_content_with_training_prompts_and_no_bench_prompt_is_trained_on():
    import json
    from pathlib import Path

    from training.prompts import _Pools, make_prompts

    train, held = _Pools(False), _Pools(True)
    for name, pool in vars(train).items():
        assert pool and getattr(held, name), name
        assert not set(map(repr, pool)) & set(map(repr, getattr(held, name))), name
    bench = json.loads((Path(__file__).resolve().parent.parent / "bench" / "prompts.json").read_text())["prompts"]
    trained = {m[-1]["content"] for m in make_prompts(5000, seed=20261121)}
    assert len(trained) > 2500  # varied, not a few templates repeated
    assert not trained & {p["prompt"] for p in bench}
