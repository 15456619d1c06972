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
