"""The timeline: records, Chrome trace, Gantt picture and metrics."""
