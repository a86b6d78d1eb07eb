"""benchmarks/compaction.py: the row-passes a batch costs with and without compaction."""

from benchmarks import compaction


def test_row_passes_count_every_row_until_the_last_converges_or_only_those_left():
    passes = [2, 2, 3, 4, 4, 4, 2, 3, 4]  # 9 rows: 9 run passes 1-2, 6 pass 3, 4 pass 4
    assert compaction.row_passes(passes, None) == 9 * 4
    assert compaction.row_passes(passes, compaction.BUCKETS["ideal"]) == 9 + 9 + 6 + 4
    # Powers of two, at most the batch: 9 (not 16), 9, 8, 4.
    assert compaction.row_passes(passes, compaction.BUCKETS["powers of 2"]) == 9 + 9 + 8 + 4
    assert compaction.row_passes(passes, compaction.BUCKETS["multiples of 8"]) == 9 + 9 + 8 + 8


def test_batches_replay_the_decode_stages_length_sorted_batches():
    lines = [{"id": f"test:{i:06d}", "source_tokens": tokens, "passes": passes}
             for i, (tokens, passes) in enumerate([(5, 1), (30, 4), (3, 2), (5, 3), (12, 2)])]
    # Buckets 8/16/32, decoder shapes (S, T): (8, 8) for 3 tokens, (8, 16) for 5, (16, 32)
    # for 12, (32, 32) for 30; within a shape shortest first, then by id.
    assert compaction.batches(lines, (8, 16, 32), batch_size=2) == [[2], [1, 3], [2], [4]]
    result = compaction.saving("m", lines, (8, 16, 32), batch_size=2)
    assert result.row_passes == 2 + 2 * 3 + 2 + 4
    assert result.saved["ideal"] == 1 - (2 + (2 + 1 + 1) + 2 + 4) / 14
