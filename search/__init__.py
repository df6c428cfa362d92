"""search: the cost model of a partitioned program and the Monte Carlo tree search
that finds good partitionings with it."""
