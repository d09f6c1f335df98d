"""The ranges of speculative decoding a request, the planner and a node all check against."""

DRAFT_TOKENS = (1, 16)  # the most tokens drafted per trip
DEPTH = (1, 16)  # speculative windows in flight round the ring
