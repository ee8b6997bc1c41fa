package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// Image is a row of images: a registered image.
type Image struct {
	Name       string `gorm:"column:name;primaryKey"`
	SourceURL  string `gorm:"column:source_url"`
	SHA256     string `gorm:"column:sha256"`
	Format     string `gorm:"column:format"`
	MinDiskMiB int64  `gorm:"column:min_disk_mib"`
	Prefetch   bool   `gorm:"column:prefetch"`
	// Firmware is what VMs of the image boot with: bios or uefi.
	Firmware  string    `gorm:"column:firmware"`
	CreatedAt time.Time `gorm:"column:created_at"`
	UpdatedAt time.Time `gorm:"column:updated_at"`
}

// TableName is the table of Image.
func (Image) TableName() string { return "images" }

// ErrImageInUse is returned by DeleteImage while VMs use the image.
var ErrImageInUse = errors.New("image is used by VMs")

// InsertImage registers an image; ErrDuplicateName when the name is taken.
func (s *Store) InsertImage(ctx context.Context, img Image) (Image, error) {
	t := now()
	img.CreatedAt, img.UpdatedAt = t, t
	if img.Firmware == "" {
		img.Firmware = "bios"
	}
	err := s.db.WithContext(ctx).Create(&img).Error
	if isDuplicate(err) {
		return Image{}, fmt.Errorf("image %s: %w", img.Name, ErrDuplicateName)
	}
	if err != nil {
		return Image{}, fmt.Errorf("insert image %s: %w", img.Name, err)
	}
	return img, nil
}

// GetImage returns one image; ErrNotFound when none has this name.
func (s *Store) GetImage(ctx context.Context, name string) (Image, error) {
	var img Image
	err := s.db.WithContext(ctx).Where("name = ?", name).Take(&img).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Image{}, fmt.Errorf("image %s: %w", name, ErrNotFound)
	}
	if err != nil {
		return Image{}, fmt.Errorf("read image %s: %w", name, err)
	}
	return img, nil
}

// ListImages returns a page of images by name, after the name after.
func (s *Store) ListImages(ctx context.Context, after string, limit int) ([]Image, error) {
	var out []Image
	if err := keysetPage(s.db.WithContext(ctx), "name", after, limit).Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	return out, nil
}

// UpdateImage changes what an image may change in place.
func (s *Store) UpdateImage(ctx context.Context, name string, minDiskMiB int64, prefetch bool) (Image, error) {
	res := s.db.WithContext(ctx).Model(&Image{}).Where("name = ?", name).
		Updates(map[string]any{"min_disk_mib": minDiskMiB, "prefetch": prefetch, "updated_at": now()})
	if res.Error != nil {
		return Image{}, fmt.Errorf("update image %s: %w", name, res.Error)
	}
	if res.RowsAffected == 0 {
		return Image{}, fmt.Errorf("image %s: %w", name, ErrNotFound)
	}
	return s.GetImage(ctx, name)
}

// ImageUsers returns up to limit VMs (id and name) of the image.
func (s *Store) ImageUsers(ctx context.Context, name string, limit int) ([]VM, error) {
	var vms []VM
	err := s.db.WithContext(ctx).Select("id", "name").Where("image = ?", name).Order("name").Limit(limit).Find(&vms).Error
	if err != nil {
		return nil, fmt.Errorf("read vms of image %s: %w", name, err)
	}
	return vms, nil
}

// DeleteImage removes an image unless a VM uses it (ErrImageInUse). The
// check and the delete are one statement, so a VM row inserted before it
// keeps the image.
func (s *Store) DeleteImage(ctx context.Context, name string) (Image, error) {
	var img Image
	err := s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Where("name = ?", name).Take(&img).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return fmt.Errorf("image %s: %w", name, ErrNotFound)
			}
			return err
		}
		res := tx.Exec("DELETE FROM images WHERE name = ? AND NOT EXISTS (SELECT 1 FROM vms WHERE vms.image = ?)", name, name)
		if res.Error != nil {
			return res.Error
		}
		if res.RowsAffected == 0 {
			return fmt.Errorf("image %s: %w", name, ErrImageInUse)
		}
		return nil
	})
	if err != nil {
		return Image{}, err
	}
	return img, nil
}

// ImagesWithDigest counts the images registered with this sha256.
func (s *Store) ImagesWithDigest(ctx context.Context, sha256 string) (int64, error) {
	var n int64
	err := s.db.WithContext(ctx).Model(&Image{}).Where("sha256 = ?", sha256).Count(&n).Error
	return n, err
}
