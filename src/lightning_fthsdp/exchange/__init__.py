"""The data plane across replica groups: the cross-group process group and its abort (``comm``), and the gradient
average over it (``average``)."""
