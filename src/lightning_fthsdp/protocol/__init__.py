"""What crosses the wire between the processes of a job, shared by both sides: the quorum request and answer
(``quorum``), every endpoint's request body encoded and parsed (``requests``, on the checks of ``fields``), the other
answers both sides touch (``answers``), and the run records between a replica group and its launcher (``records``)."""
