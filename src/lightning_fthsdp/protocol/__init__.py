"""What crosses the wire between the processes of a job, shared by both sides: the quorum request and answer between
the lighthouse and the ranks (``quorum``), the run records between a replica group and its launcher (``records``)."""
