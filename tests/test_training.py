"""The distillation script's data handling: validation stays unseen as data grows."""

import random

import pytest

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


def test_a_time_budget_cuts_off_a_random_share_of_the_prompts_not_the_longest():
    """Data generation stops at a deadline: the prompts answered first must be a fair sample of all of them,
    while each batch stays of similar length."""
    from training.batched import budget_order

    rng = random.Random(0)
    lengths = [rng.randint(20, 600) for _ in range(3000)]
    order = budget_order(lengths, 32, seed=1)
    assert sorted(order) == list(range(len(lengths)))
    first = sorted(lengths[i] for i in order[:768])  # a budget that answers a quarter (three blocks of 8 batches)
    everything = sorted(lengths)
    assert abs(first[len(first) // 2] - everything[len(everything) // 2]) < 30  # median of all: about 310
    assert first[-1] > everything[int(0.95 * len(everything))]  # the longest prompts are reached too
    for s in range(0, 768, 32):  # a batch's rows come from one length-sorted block
        batch = [lengths[i] for i in order[s : s + 32]]
        assert batch == sorted(batch)


def _chat_prompts(tokenizer, texts=("What is 2 + 3?", "Name a color.", "Write one word about the sea.", "Say hi.")):
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for text in texts
    ]


def _greedy_alone(runner, prompt, eos, max_new):
    """One prompt at a time through the runner's own forward: the reference for the batched code."""
    cache, out = runner.new_cache(), []
    logits = runner.forward(cache, prompt, 1)
    while len(out) < max_new:
        out.append(int(logits[-1].argmax()))
        if out[-1] in eos:
            break
        logits = runner.forward(cache, [out[-1]], 1)
    return out


def test_batched_generation_with_finished_rows_dropped_matches_one_prompt_at_a_time(target_model, tokenizer):
    """The data generator's left-padded batch, compacted as rows finish, answers each prompt as the
    target alone does, and its soft labels line up with the answer tokens."""
    import torch

    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.batched import generate

    runner = LeanLlamaRunner(target_model, len(tokenizer), 512)
    prompts = _chat_prompts(tokenizer)

    def alone(prompt, eos, max_new):
        return _greedy_alone(runner, prompt, eos, max_new)

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


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_generation_in_the_served_forms_answers_each_prompt_as_the_server_alone_bit_for_bit(
    target_model, tokenizer, activations
):
    """training.batched.generate_served runs the rows of a step in one pass of the runner's own product form, whose
    rows are batch-invariant: each answer, its labels and its features are the same runner's alone, bit for bit."""
    import torch

    from specdec import models
    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.batched import generate_served

    gguf = models.gguf_file(models.DEFAULT_TARGET)
    runner = LeanLlamaRunner(target_model, len(tokenizer), 512, gguf=gguf, activations=activations)
    prompts = _chat_prompts(tokenizer)
    free = _greedy_alone(runner, prompts[1], set(), 3)
    eos = {free[2]}  # the second prompt stops after 3 tokens: the pass's rows shrink while the others go on
    expected = [_greedy_alone(runner, p, eos, 10) for p in prompts]
    assert len(expected[1]) == 3 and max(map(len, expected)) > 3
    feats = []
    got = generate_served(runner, prompts, 10, 0.0, 1.0, eos, seed=0, features=feats)
    assert [ids for ids, _, _ in got] == expected
    for prompt, (ids, top_i, top_v), f in zip(prompts, got, feats):
        assert top_i.shape == top_v.shape == (len(ids), 20) and top_i[:, 0].tolist() == ids
        assert torch.isfinite(top_v.float()).all()
        fed = prompt + ids[:-1]  # the head's data: the features of every position fed, as one pass alone gives them
        _, (alone,) = runner.forward_batch([runner.new_cache()], [fed], [1], True, norm_rows=[len(fed)])
        assert f.dtype == torch.bfloat16 and torch.equal(f, alone.to(torch.bfloat16))


def test_teacher_forced_labels_equal_the_labels_recorded_while_generating(target_model, tokenizer):
    """On-policy data labels given answers in one left-padded pass (training.batched.score); at every
    position its top-20 must be what the target records when it generates that answer itself."""
    import torch

    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.batched import generate, score

    runner = LeanLlamaRunner(target_model, len(tokenizer), 512)
    prompts = _chat_prompts(tokenizer)
    got = generate(runner, prompts, 12, 0.7, 0.9, set(), seed=3)  # sampled: answers off the greedy path too
    labels = score(runner, [(p, ids) for p, (ids, _, _) in zip(prompts, got)])
    assert len({len(p) for p in prompts}) > 1  # the rows are padded differently in the two batches
    for (ids, gen_i, gen_v), (top_i, top_v) in zip(got, labels):
        assert top_i.shape == top_v.shape == (len(ids), 20) and top_i.dtype == gen_i.dtype
        assert torch.equal(top_i[:, :5], gen_i[:, :5])  # near-ties further down may swap in float rounding
        assert torch.allclose(top_v.float(), gen_v.float(), atol=1e-2)  # fp16 storage: 1e-3 apart at -5


def test_a_restricted_vocabulary_draft_generates_token_ids_from_its_kept_tokens(tiny_draft, tokenizer):
    """A draft whose output layer keeps some tokens returns logits over those only; the batched generator
    must turn those indices back into token ids, greedy as its runner alone decodes, sampled inside the set."""
    import copy

    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.batched import generate

    draft = copy.deepcopy(tiny_draft)
    kept = sorted(range(7, len(tokenizer), 97))
    draft.config.specdec_output_token_ids = kept
    runner = LeanLlamaRunner(draft, len(tokenizer), 512)
    prompts = _chat_prompts(tokenizer)
    greedy = generate(runner, prompts, 8, 0.0, 1.0, set(), seed=0, top_k_labels=0)
    assert [ids for ids, _, _ in greedy] == [_greedy_alone(runner, p, set(), 8) for p in prompts]
    assert all(top_i is None and top_v is None for _, top_i, top_v in greedy)
    sampled = generate(runner, prompts, 8, 1.0, 1.0, set(), seed=0, top_k_labels=0)
    tokens = {t for ids, _, _ in sampled for t in ids}
    assert tokens <= set(kept) and len(tokens) > 8  # spread over the set, not one index repeated


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


def test_features_recorded_while_generating_are_the_target_s_final_norm_output_at_each_fed_position(
    target_model, tokenizer
):
    """The head's data: per row the features of every position the target fed (the prompt's, then each answer
    token but the last), each the final-norm output of a lone teacher-forced pass at that position."""
    import torch

    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.batched import generate

    runner = LeanLlamaRunner(target_model, len(tokenizer), 512)
    prompts = _chat_prompts(tokenizer)
    feats = []
    got = generate(runner, prompts, 8, 0.7, 0.9, set(), seed=5, features=feats)
    assert len(feats) == len(prompts) and len({len(p) for p in prompts}) > 1
    for prompt, (ids, _, _), f in zip(prompts, got, feats):
        seq = prompt + ids
        assert f.shape == (len(seq) - 1, target_model.config.hidden_size) and f.dtype == torch.bfloat16
        with torch.no_grad():
            alone = target_model.model(torch.tensor([seq[:-1]])).last_hidden_state[0]
        assert torch.allclose(f.float(), alone, atol=0.05, rtol=0.02)  # bf16 storage of the same vectors


def test_the_head_s_second_training_pass_computes_what_a_second_draft_step_sees(target_model, tokenizer):
    """Training-time test: at every p the second pass reads the head's own g_{p-1} and attends to the first
    pass's entries before p, as a second draft step does over a cache of the target's features. Recomputing
    each p as that step (a sequence whose last entry reads g_{p-1}) gives the same g."""
    import torch

    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.head import Head

    torch.manual_seed(0)
    runner = LeanLlamaRunner(target_model, len(tokenizer), 64)
    head = Head(runner, intermediate=64)
    T, H = 12, runner.embed.shape[1]
    ids = torch.randint(0, len(tokenizer), (1, T))
    fprev = torch.randn(1, T, H)
    fprev[:, 0] = 0
    valid = torch.ones(1, T, dtype=torch.bool)
    with torch.no_grad():
        g1, g2 = head(ids, fprev, valid, second=True)
        for p in range(1, T):
            f = fprev[:, : p + 1].clone()
            f[:, p] = g1[:, p - 1]
            step, _ = head(ids[:, : p + 1], f, valid[:, : p + 1], second=False)
            assert torch.allclose(step[0, p], g2[0, p], atol=1e-5), p


def test_a_head_saved_by_training_computes_in_the_draft_service_what_it_computed_in_training(
    tmp_path, target_model, tokenizer
):
    """training.head's module and its saved folder, loaded as the draft service loads a head and run by the lean
    runner: the same g at every position and the same scored logits, so what training measured is what is served."""
    import torch

    from specdec import models
    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.head import Head, save

    torch.manual_seed(1)
    target_runner = LeanLlamaRunner(target_model, len(tokenizer), 64)
    trained = Head(target_runner, intermediate=96)
    for p in trained.parameters():  # norms away from ones, so a swapped or dropped weight shows
        p.data += 0.05 * torch.randn_like(p)
    kept = list(range(0, len(tokenizer), 7))
    save(trained, target_model, kept, tmp_path / "head")
    served = LeanLlamaRunner(models.load_model(str(tmp_path / "head")), len(tokenizer), 64, matmul="linear")
    T, H = 9, target_runner.embed.shape[1]
    ids = torch.randint(0, len(tokenizer), (1, T))
    fprev = torch.randn(1, T, H)
    with torch.no_grad():
        for p in trained.parameters():  # the file holds bf16: compare with the weights as stored
            p.data = p.data.bfloat16().float()
        g, _ = trained(ids, fprev, torch.ones(1, T, dtype=torch.bool), second=False)
        logits, norms = served.forward_batch(
            [served.new_cache()], [ids[0].tolist()], [T], scored_only=True, features_in=[fprev[0]], norm_rows=[T]
        )
    torch.testing.assert_close(norms[0], g[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], g[0] @ target_runner.lm_head[torch.tensor(kept)].T, atol=1e-3, rtol=1e-4)


def test_head_training_saves_each_better_checkpoint_as_it_is_found(tmp_path, target_model, tokenizer):
    """A run cut short (a lent GPU's time limit) keeps the best head found so far: training hands each better
    checkpoint to its caller, which saves it, and ends on the best of them."""
    import random
    import types

    import torch

    from specdec.runners.lean_llama import LeanLlamaRunner
    from training.head import Head, train

    torch.manual_seed(2)
    runner = LeanLlamaRunner(target_model, len(tokenizer), 64)
    H, rng = runner.embed.shape[1], random.Random(3)
    records = []
    for _ in range(24):
        n, prompt = rng.randrange(8, 14), 4
        ids = torch.tensor([rng.randrange(len(tokenizer)) for _ in range(n)], dtype=torch.int32)
        records.append({"ids": ids, "prompt_len": prompt, "feats": torch.randn(n - 1, H).bfloat16()})
    rows = runner.lm_head[torch.arange(0, len(tokenizer), 9)].float()
    head = Head(runner, intermediate=64)
    args = types.SimpleNamespace(
        lr=1e-3, train_minutes=0.03, batch_tokens=64, check_every=1, bf16=False, second_pass=True
    )
    saved = []
    trained = train(head, rows, records[4:], records[:4], args, lambda best: saved.append(best.fc.weight.clone()))
    assert saved, "validation improved at least once, and each improvement was handed over"
    torch.testing.assert_close(trained.fc.weight, saved[-1])  # the run ends on the last (best) checkpoint


def test_a_head_scores_the_tokens_its_answers_hold_most_often_and_rescoring_changes_only_its_list(tmp_path):
    """--scored-tokens keeps the n of the scored tokens the answers hold most often (ties to the lower id), in id
    order, never a token outside them; --stage rows writes that list into a trained head's config and nothing else."""
    import json

    from specdec.head import rescore
    from training.head import most_frequent

    answers = [[5, 9, 9, 3, 7], [9, 3, 11, 11, 11, 4]]  # 9 and 11: three times; 3 twice; 4, 5, 7 once; 11 not scored
    assert most_frequent([3, 4, 5, 7, 9], answers, 3) == [3, 4, 9]  # 9, 3, then the lowest id of those seen once
    assert most_frequent([3, 4, 5, 7, 9], answers, 9) == [3, 4, 5, 7, 9]
    config = {"hidden_size": 8, "specdec_output_token_ids": [3, 4, 5, 7, 9], "specdec_head": {"target": "t"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rescore(tmp_path, [3, 9])
    assert json.loads((tmp_path / "config.json").read_text()) == {**config, "specdec_output_token_ids": [3, 9]}


def test_a_head_trains_for_a_llama_target_named_by_its_folder_and_the_draft_service_loads_it_over_that_target(
    tmp_path, monkeypatch, capsys, tiny_draft, tokenizer
):
    """The route to a head for the users' own target (Llama-3.2-3B on their card): training.head's command with
    --target a model folder, not the embedded GGUF, takes its answers and features, trains at the target's own MLP
    width and saves a head that loads, as the draft service loads it, over that target."""
    import json

    from specdec import head, models
    from training import head as training_head

    (tmp_path / "cache").mkdir()
    (models.cache_dir() / "kernels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "kernels").symlink_to(models.cache_dir() / "kernels", target_is_directory=True)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # its answers cached here, the kernels' build not
    tiny_draft.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    out = tmp_path / "head"
    training_head.main(
        ["--target", str(tmp_path / "llama"), "--num-prompts", "40", "--max-new", "8", "--batch-size", "8"]
        + ["--gen-minutes", "0.5", "--train-minutes", "0.01", "--check-every", "1", "--out", str(out)]
    )
    printed = capsys.readouterr().out  # the budgets are caps; the first step always runs, and is checked
    assert "data: 40 answers" in printed and "train: 20 answers" in printed and "step 1:" in printed, printed
    config = json.loads((out / "config.json").read_text())
    assert config["specdec_head"]["target"] == str(tmp_path / "llama")
    assert config["intermediate_size"] == tiny_draft.config.intermediate_size
    assert head.is_head(str(out)) and models.load_tokenizer(str(out)).vocab == tokenizer.vocab
    loaded = models.load_model(str(out))
    assert loaded.config.hidden_size == tiny_draft.config.hidden_size
