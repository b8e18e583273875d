"""layers.embed: the indexing gather it takes for 2-16 ids gives nn.Embedding's rows exactly."""

import torch

from quantship.models.layers import embed, embedding


def test_embed_gives_the_embedding_rows_for_every_batch_size():
    torch.manual_seed(0)
    table = embedding(97, 24).to(torch.bfloat16)
    for shape in [(1, 1), (1, 2), (1, 16), (1, 17), (4, 4), (2, 40)]:
        ids = torch.randint(0, 97, shape)
        got = embed(table, ids)
        assert got.shape == (*shape, 24)
        assert torch.equal(got, table(ids)), shape
