# A project is imported by its name.
terraform import kvm_project.team_a team-a
