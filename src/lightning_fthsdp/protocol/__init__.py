"""What crosses the wire between the lighthouse and the ranks, shared by both sides: the quorum request and answer
(``quorum``)."""
