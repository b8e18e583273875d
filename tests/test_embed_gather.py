"""layers.Embedding: the indexing gather it takes for 2-16 ids gives F.embedding's rows exactly."""

import torch
import torch.nn.functional as F

from quantship.models.layers import embedding


def test_the_models_embedding_gives_f_embeddings_rows_for_every_batch_size():
    torch.manual_seed(0)
    table = embedding(97, 24).to(torch.bfloat16)
    for shape in [(1, 1), (1, 2), (1, 16), (1, 17), (4, 4), (2, 40)]:
        ids = torch.randint(0, 97, shape)
        got = table(ids)
        assert got.shape == (*shape, 24)
        assert torch.equal(got, F.embedding(ids, table.weight)), shape
