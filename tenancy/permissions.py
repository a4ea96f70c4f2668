"""The permissions of operator actions on teams, limits and usage (checked by ``common.permissions``)."""

VIEW_TEAMS = "tenancy.view_team"
ADD_TEAMS = "tenancy.add_team"
CHANGE_TEAMS = "tenancy.change_team"
DELETE_TEAMS = "tenancy.delete_team"
SET_LIMITS = "tenancy.set_limits"  # the shipped admin group and superusers only
VIEW_USAGE = "tenancy.view_usage"  # one's own jobs' usage
VIEW_ALL_USAGE = "tenancy.view_all_usage"  # everyone's
# A job's priority above 0 (ahead of the others): operators up to the ceiling, admins any (up to the API's 1000).
PRIORITIZE_JOBS = "tenancy.prioritize_jobs"
PRIORITIZE_JOBS_ANY = "tenancy.prioritize_jobs_any"
OPERATOR_PRIORITY_CEILING = 100
