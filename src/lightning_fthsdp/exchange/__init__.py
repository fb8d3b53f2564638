"""The data plane across replica groups: the cross-group process group, its abort, and the gradient all-reduce."""
