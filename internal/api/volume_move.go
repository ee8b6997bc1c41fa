package api

// VolumeMoving is the state of a volume while it moves to another host
// (POST /v1/volumes/{id}/move): it is on two hosts until the move ends and
// cannot be attached, grown or deleted meanwhile.
const VolumeMoving = "moving"

// VolumeMove is the body of POST /v1/volumes/{id}/move: the host to move
// the detached volume to. The answer is the volume on its new host.
type VolumeMove struct {
	Host string `json:"host"`
}
