"""The data plane across replica groups: the cross-group communicator and its abort (``comm``), built per quorum
from a rendezvous on the lighthouse's store (``rendezvous``) and raw backend groups (``backends``), retired groups
destroyed off the step (``reaper``), how it fails (``errors``), and the gradient average over it (``average``)."""
