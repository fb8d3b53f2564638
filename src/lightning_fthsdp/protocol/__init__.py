"""What crosses the wire between the lighthouse and the ranks, shared by both sides: the quorum request and answer
(``quorum``), every endpoint's request body encoded and parsed (``requests``, on the checks of ``fields``), and the
other answers both sides touch (``answers``)."""
